/*
 * A wall clock that jumps for one process only: an LD_PRELOAD library for bench/chaos.py.
 *
 * Stepping CLOCK_REALTIME for real (an NTP step, a VM resumed after hours) would step it for
 * every process on the machine.  This library makes one process see the jump instead: its
 * clock_gettime(CLOCK_REALTIME*), gettimeofday() and time() return the real time plus an offset
 * read from a file, which another process changes while it runs.  Monotonic and boot-time clocks
 * are untouched, as they are by a real step; so are timeouts the kernel measures itself.
 *
 * The file named by GPUWATCH_CLOCK_OFFSET_FILE holds one signed 64-bit integer in native byte
 * order: the offset in nanoseconds.  It is mapped shared and read on every call, so a new value
 * written in place (8 aligned bytes) takes effect at once, with no system call on the clock
 * path.  Without the variable, or with a file that cannot be mapped, the offset is 0.
 *
 * Build: cc -O2 -Wall -Wextra -shared -fPIC -o libclockjump.so clockjump.c -ldl
 * Use:   GPUWATCH_CLOCK_OFFSET_FILE=/tmp/offset LD_PRELOAD=$PWD/libclockjump.so program
 */

#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

typedef int (*clock_gettime_fn)(clockid_t, struct timespec *);

static clock_gettime_fn real_clock_gettime;
static const volatile int64_t *offset_ns;

__attribute__((constructor)) static void clockjump_init(void)
{
    real_clock_gettime = (clock_gettime_fn)dlsym(RTLD_NEXT, "clock_gettime");
    const char *path = getenv("GPUWATCH_CLOCK_OFFSET_FILE");
    if (path == NULL || *path == '\0')
        return;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return;
    void *map = mmap(NULL, sizeof(int64_t), PROT_READ, MAP_SHARED, fd, 0);
    close(fd);
    if (map != MAP_FAILED)
        offset_ns = (const volatile int64_t *)map;
}

static int64_t current_offset(void)
{
    return offset_ns != NULL ? __atomic_load_n(offset_ns, __ATOMIC_RELAXED) : 0;
}

static int real_time(clockid_t clock, struct timespec *ts)
{
    if (real_clock_gettime != NULL)
        return real_clock_gettime(clock, ts);
    /* Called before the constructor ran (another library's constructor): ask the kernel. */
    return (int)syscall(SYS_clock_gettime, clock, ts);
}

static void shift(struct timespec *ts)
{
    int64_t offset = current_offset();
    if (offset == 0)
        return;
    int64_t ns = (int64_t)ts->tv_nsec + offset % 1000000000LL;
    ts->tv_sec += (time_t)(offset / 1000000000LL);
    if (ns < 0) {
        ns += 1000000000LL;
        ts->tv_sec -= 1;
    } else if (ns >= 1000000000LL) {
        ns -= 1000000000LL;
        ts->tv_sec += 1;
    }
    ts->tv_nsec = (long)ns;
}

__attribute__((visibility("default"))) int clock_gettime(clockid_t clock, struct timespec *ts)
{
    int rc = real_time(clock, ts);
    if (rc == 0 && (clock == CLOCK_REALTIME || clock == CLOCK_REALTIME_COARSE))
        shift(ts);
    return rc;
}

__attribute__((visibility("default"))) int gettimeofday(struct timeval *tv, void *tz)
{
    (void)tz; /* obsolete: glibc fills nothing useful into it either */
    struct timespec ts;
    int rc = real_time(CLOCK_REALTIME, &ts);
    if (rc != 0)
        return rc;
    shift(&ts);
    tv->tv_sec = ts.tv_sec;
    tv->tv_usec = (suseconds_t)(ts.tv_nsec / 1000);
    return 0;
}

__attribute__((visibility("default"))) time_t time(time_t *out)
{
    struct timespec ts;
    if (real_time(CLOCK_REALTIME, &ts) != 0)
        return (time_t)-1;
    shift(&ts);
    if (out != NULL)
        *out = ts.tv_sec;
    return ts.tv_sec;
}
