/*
 * A fake libnvidia-ml.so.1 for tests and the gpuwatch demo.
 *
 * The real, unmodified NVML bindings (pynvml, and gpustat/nvitop on top of it) load this library
 * through LD_LIBRARY_PATH, so everything above the C ABI is the code that runs on a real node.
 * Structures and the call protocol therefore follow nvml.h exactly; pynvml.py declares the same
 * layouts as ctypes structures.
 *
 * What the "driver" reports comes from a line-based state file named by the environment variable
 * GPUWATCH_FAKE_NVML_STATE (gpuwatch/simulate/fakenvml.py writes it):
 *
 *   # comments and blank lines are ignored; tokens are key=value; "double quoted" values may
 *   # contain spaces (backslash escapes " and \ inside quotes); a token starting with # ends a line
 *   driver_version 550.54.15
 *   nvml_version 12.550.54.15
 *   cuda_version 12040
 *   device index=0 uuid=GPU-... name="NVIDIA H100 80GB HBM3" total=85520809984 reserved=0
 *          unattributed=0 util_gpu=0 util_mem=0 pci_bus_id=00000000:18:00.0 mig=0
 *   process device=0 pid=1234 used=1073741824 type=compute
 *   process device=0 pid=99999 used=na type=graphics ghost=1 gi=1 ci=0
 *   fail symbol=nvmlDeviceGetMemoryInfo error=15 device=1
 *
 * (each record is one line; the device line is wrapped above only for width).
 *
 * Device keys: index (default: position among device lines), uuid, name, total, reserved,
 *   unattributed (memory in use that no listed process accounts for), util_gpu, util_mem,
 *   pci_bus_id, mig (0/1; absent means the GPU is not MIG-capable and nvmlDeviceGetMigMode
 *   answers NOT_SUPPORTED, as it does on such GPUs), pci_device_id, pci_subsystem_id,
 *   cc (compute capability, e.g. 9.0), brand (nvmlBrandType_t number).
 *   Indices should be 0..N-1: the device count is the number of device lines.
 * Process keys: device, pid, used (bytes, or "na" for NVML_VALUE_NOT_AVAILABLE),
 *   type (compute, graphics or compute+graphics), ghost (1: listed although the PID is gone),
 *   gi/ci (MIG GPU/compute instance ids; default 0xFFFFFFFF, meaning none).
 * Fail keys: symbol (an exported name, "*" for every call, or a prefix such as "nvmlInit*"),
 *   error (nvmlReturn_t), device (only calls aimed at that device index match; calls that name
 *   no device, such as nvmlDeviceGetCount, never do), times (only the first N calls the record
 *   matches fail, later ones go through: a transient fault; absent or 0, every call fails).
 *   A call is aimed at a device when it takes its handle (stubs included, see below) or looks it
 *   up by index, UUID or PCI bus id, so "fail symbol=* error=15 device=1" makes GPU 1 lost: even
 *   its handle lookup fails, as nvmlDeviceGetHandleByIndex does for a GPU that fell off the bus.
 *   The fail table is consulted first, before the initialisation check.
 *   "times" is counted in each process that loaded the library.  A rewrite of the state file
 *   keeps the count of each counted record it holds again (a rewrite for another reason does not
 *   re-arm a spent fault); a record removed and added again starts afresh.
 *
 * A line that cannot be parsed is skipped (one note on stderr per load of the file); a record with
 * an unknown key is skipped as a whole, so a typo cannot silently produce a different node.
 *
 * The file is stat()ed on every API entry and re-read when its identity (device, inode, size,
 * mtime, ctime) changes; writers replace it atomically (write a temporary file, then rename).
 * Without a state file nvmlInit* answers DRIVER_NOT_LOADED; if the file disappears after a
 * successful init, the last state read stays in force.
 *
 * Like the real driver, a process that has exited stops holding memory and drops out of the
 * process lists and the used-memory figure.  A zombie whose other threads still run keeps its
 * memory (the leader exited, e.g. via pthread_exit, but a helper thread such as an NCCL heartbeat
 * lives on); ghost=1 keeps an entry listed although the PID does not exist at all.
 * A real driver knows which of its clients live without reading /proc in the caller. This one
 * holds a pidfd on each listed process (opened at its first query, closed when the state file
 * is read again or the library shut down) and asks all of them at once with one poll(), at most
 * once per LIVENESS_NS: a pidfd turns readable only once the whole thread group has exited.
 * An exit a pidfd reports is confirmed in /proc, which has the last word: a descriptor the
 * caller closed under the library, or a PID that names another process now, does not make a
 * live process vanish from the lists.
 * Where it has no pidfd (an old kernel, a PID that is not a process's, a /proc of another PID
 * namespace, a quarter of the caller's descriptor limit taken) it reads /proc/PID/stat instead,
 * once per LIVENESS_NS for that process. Either way an exit shows within that time, and a
 * rewrite of the state file forgets every reading.
 *
 * Build: cc -O2 -Wall -Wextra -shared -fPIC -pthread -Wl,-soname,libnvidia-ml.so.1 \
 *           -o libnvidia-ml.so.1 fake_nvml.c
 */

#define _GNU_SOURCE
#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

#define FAKE_API __attribute__((visibility("default")))

/* nvmlReturn_t and the other enums are C enums in nvml.h: int-sized on every platform NVML
 * ships for, which is also what ctypes assumes. */
typedef int nvmlReturn_t;

enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_NOT_FOUND = 6,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_DRIVER_NOT_LOADED = 9,
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25,
};

#define NVML_VALUE_NOT_AVAILABLE 0xFFFFFFFFFFFFFFFFULL
#define NO_INSTANCE 0xFFFFFFFFu

#define MAX_DEVICES 64
#define MAX_PROCESSES 4096
#define MAX_FAILURES 256
#define MAX_TOKENS 64

/* ---- ABI structures (nvml.h; pynvml.py mirrors them) ---------------------------------------- */

/* Opaque to callers; handles are addresses inside g_slots, so they stay valid across reloads. */
struct nvmlDevice_st {
    unsigned char unused;
};
typedef struct nvmlDevice_st *nvmlDevice_t;

typedef struct {
    char busIdLegacy[16];
    unsigned int domain;
    unsigned int bus;
    unsigned int device;
    unsigned int pciDeviceId;
    unsigned int pciSubSystemId;
    char busId[32];
} nvmlPciInfo_t; /* v3 */

typedef struct {
    char busId[16];
    unsigned int domain;
    unsigned int bus;
    unsigned int device;
    unsigned int pciDeviceId;
    unsigned int pciSubSystemId;
    unsigned int reserved0;
    unsigned int reserved1;
    unsigned int reserved2;
    unsigned int reserved3;
} nvmlPciInfo_v2_t; /* what nvmlDeviceGetPciInfo and _v2 fill */

typedef struct {
    unsigned long long total;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_t;

typedef struct {
    unsigned int version;
    unsigned long long total;
    unsigned long long reserved;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_v2_t;

#define NVML_STRUCT_VERSION(type, ver) ((unsigned int)(sizeof(type) | ((ver) << 24U)))
#define nvmlMemory_v2 NVML_STRUCT_VERSION(nvmlMemory_v2_t, 2)

typedef struct {
    unsigned int gpu;
    unsigned int memory;
} nvmlUtilization_t;

typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
} nvmlProcessInfo_v1_t;

typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlProcessInfo_v2_t; /* _v3 has the same layout */

_Static_assert(sizeof(nvmlPciInfo_t) == 68, "nvmlPciInfo_t layout");
_Static_assert(sizeof(nvmlPciInfo_v2_t) == 52, "nvmlPciInfo_v2_t layout");
_Static_assert(sizeof(nvmlMemory_v2_t) == 40, "nvmlMemory_v2_t layout");
_Static_assert(nvmlMemory_v2 == 0x02000028, "nvmlMemory_v2 version word");
_Static_assert(sizeof(nvmlProcessInfo_v1_t) == 16, "nvmlProcessInfo_v1_t layout");
_Static_assert(sizeof(nvmlProcessInfo_v2_t) == 24, "nvmlProcessInfo_v2_t layout");

/* ---- state ---------------------------------------------------------------------------------- */

enum { PROC_COMPUTE = 1, PROC_GRAPHICS = 2 };

struct fake_device {
    int present;
    char uuid[96];
    char name[96];
    unsigned long long total, reserved, unattributed;
    unsigned int util_gpu, util_mem;
    char bus_id[32]; /* normalised to NVML's "%08X:%02X:%02X.%X" */
    unsigned int domain, bus, dev, func;
    unsigned int pci_device_id, pci_subsystem_id;
    int mig; /* -1: not MIG-capable */
    int cc_major, cc_minor;
    int brand;
};

struct fake_process {
    unsigned int device;
    unsigned int pid;
    unsigned long long used;
    unsigned int types;
    int ghost;
    unsigned int gi, ci;
};

struct fake_failure {
    char symbol[128];
    int prefix; /* symbol ended in '*': match by prefix */
    int error;
    int device; /* -1: any call */
    int times;  /* 0: every matching call fails; N: only the first N */
    int used;   /* matching calls failed so far (while times > 0) */
};

struct fake_state {
    char driver_version[80];
    char nvml_version[80];
    int cuda_version;
    unsigned int n_devices;
    struct fake_device devices[MAX_DEVICES]; /* indexed by device index */
    unsigned int n_processes;
    struct fake_process processes[MAX_PROCESSES];
    unsigned int n_failures;
    struct fake_failure failures[MAX_FAILURES];
};

struct file_identity {
    int valid;
    dev_t dev;
    ino_t ino;
    off_t size;
    struct timespec mtim, ctim;
};

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static struct fake_state g_state;   /* what the API serves */
static struct fake_state g_scratch; /* parse target, copied over g_state once complete */
static struct file_identity g_seen;
static int g_loaded;   /* a state file has been read at least once */
static int g_refcount; /* nvmlInit* successes minus nvmlShutdown successes */
static struct nvmlDevice_st g_slots[MAX_DEVICES];
static unsigned int g_matched[MAX_PROCESSES]; /* scratch for process queries, used under g_lock */
/* Per process record of g_state, under g_lock: when its liveness was last read (CLOCK_MONOTONIC
 * ns, 0: never since the state was loaded) and what it read. */
static unsigned long long g_alive_at[MAX_PROCESSES];
static unsigned char g_alive[MAX_PROCESSES];
#define LIVENESS_NS 20000000ULL /* 20 ms */
/* Per process record: a pidfd on its process (PIDFD_OPEN), none tried yet (PIDFD_UNTRIED), or
 * none to be had (PIDFD_NONE: /proc is read instead), and the descriptor. */
enum { PIDFD_UNTRIED = 0, PIDFD_OPEN = 1, PIDFD_NONE = 2 };
static unsigned char g_pidfd_state[MAX_PROCESSES];
static int g_pidfd[MAX_PROCESSES];
static struct pollfd g_pollfds[MAX_PROCESSES]; /* scratch for a sweep, used under g_lock */
static unsigned int g_polled[MAX_PROCESSES];   /* the record of each entry of g_pollfds */
static unsigned long long g_swept_at;          /* the last sweep of every pidfd, 0: none */
static unsigned int g_pidfds_open;

/* ---- parsing -------------------------------------------------------------------------------- */

/* Splits a line into tokens in place.  Quotes may appear anywhere in a token (key="a b"); they
 * are removed and backslash escapes inside them resolved.  Returns the token count, or -1. */
static int tokenize(char *p, char **tok, int max)
{
    int n = 0;
    for (;;) {
        while (*p && isspace((unsigned char)*p))
            p++;
        if (*p == '\0' || *p == '#')
            return n;
        if (n == max)
            return -1;
        char *w = p;
        int quoted = 0;
        tok[n++] = w;
        while (*p) {
            if (quoted) {
                if (*p == '\\' && p[1]) {
                    p++;
                    *w++ = *p++;
                } else if (*p == '"') {
                    quoted = 0;
                    p++;
                } else {
                    *w++ = *p++;
                }
            } else if (isspace((unsigned char)*p)) {
                break;
            } else if (*p == '"') {
                quoted = 1;
                p++;
            } else {
                *w++ = *p++;
            }
        }
        if (quoted)
            return -1;
        char stop = *p; /* read before terminating: w may equal p */
        *w = '\0';
        if (stop)
            p++;
    }
}

static int parse_u64(const char *s, unsigned long long *out)
{
    char *end;
    int base = 10;
    if (*s == '\0' || *s == '-' || *s == '+' || isspace((unsigned char)*s))
        return 0;
    if (s[0] == '0' && (s[1] == 'x' || s[1] == 'X'))
        base = 16;
    errno = 0;
    unsigned long long v = strtoull(s, &end, base);
    if (errno || *end != '\0')
        return 0;
    *out = v;
    return 1;
}

static int parse_uint(const char *s, unsigned int *out)
{
    unsigned long long v;
    if (!parse_u64(s, &v) || v > 0xFFFFFFFFULL)
        return 0;
    *out = (unsigned int)v;
    return 1;
}

static int parse_int(const char *s, int *out)
{
    unsigned long long v;
    if (!parse_u64(s, &v) || v > 0x7FFFFFFFULL)
        return 0;
    *out = (int)v;
    return 1;
}

static int copy_value(char *dst, size_t size, const char *src)
{
    size_t n = strlen(src);
    if (n >= size)
        return 0;
    memcpy(dst, src, n + 1);
    return 1;
}

/* Accepts "DDDDDDDD:BB:DD.F", "DDDD:BB:DD.F" or "BB:DD.F", in any case. */
static int parse_bus_id(const char *s, unsigned int *domain, unsigned int *bus, unsigned int *dev,
                        unsigned int *func)
{
    char tail;
    if (sscanf(s, "%x:%x:%x.%x%c", domain, bus, dev, func, &tail) == 4)
        return *bus <= 0xFF && *dev <= 0x1F && *func <= 7;
    *domain = 0;
    if (sscanf(s, "%x:%x.%x%c", bus, dev, func, &tail) == 3)
        return *bus <= 0xFF && *dev <= 0x1F && *func <= 7;
    return 0;
}

static void set_bus_id(struct fake_device *d)
{
    snprintf(d->bus_id, sizeof d->bus_id, "%08X:%02X:%02X.%X", d->domain, d->bus, d->dev,
             d->func);
}

/* How a record's KEY=VALUE value is read (struct key). */
enum value_kind {
    V_UINT,    /* unsigned int */
    V_U64,     /* unsigned long long */
    V_INT,     /* int, 0 or more */
    V_FLAG,    /* int, 0 or 1 */
    V_NONZERO, /* int, 1 or more */
    V_TEXT,    /* char[size] */
    V_NAME,    /* char[size], not empty */
    V_USED,    /* unsigned long long, or "na": NVML_VALUE_NOT_AVAILABLE */
    V_TYPES,   /* unsigned int: "compute", "graphics" or both, joined by '+' */
    V_BUS_ID,  /* struct fake_device: its PCI bus id (parse_bus_id) */
    V_CC,      /* struct fake_device: its compute capability, "MAJOR.MINOR" */
};

/* A key a record may give: where its value goes, `seen` (NULL: not asked) set once given, and
 * whether the record NEEDS it. */
struct key {
    const char *name;
    enum value_kind kind;
    void *to;
    size_t size; /* V_TEXT, V_NAME: the buffer's */
    int *seen;
    int needed;
};
enum { MAY = 0, NEEDS = 1 };

/* What parse_keys says is wrong with a record's keys. */
struct record_words {
    const char *unknown; /* a key not among them */
    const char *bad;     /* a value its key does not take */
    const char *needs;   /* a key it NEEDS, not given */
};

static int parse_value(const struct key *k, const char *val)
{
    switch (k->kind) {
    case V_UINT:
        return parse_uint(val, k->to);
    case V_U64:
        return parse_u64(val, k->to);
    case V_INT:
        return parse_int(val, k->to);
    case V_FLAG:
        return parse_int(val, k->to) && *(int *)k->to <= 1;
    case V_NONZERO:
        return parse_int(val, k->to) && *(int *)k->to != 0;
    case V_TEXT:
        return copy_value(k->to, k->size, val);
    case V_NAME:
        return copy_value(k->to, k->size, val) && *val;
    case V_USED:
        if (strcmp(val, "na"))
            return parse_u64(val, k->to);
        *(unsigned long long *)k->to = NVML_VALUE_NOT_AVAILABLE;
        return 1;
    case V_TYPES: {
        unsigned int *types = k->to;
        if (!strcmp(val, "compute"))
            *types = PROC_COMPUTE;
        else if (!strcmp(val, "graphics"))
            *types = PROC_GRAPHICS;
        else if (!strcmp(val, "compute+graphics") || !strcmp(val, "graphics+compute"))
            *types = PROC_COMPUTE | PROC_GRAPHICS;
        else
            return 0;
        return 1;
    }
    case V_BUS_ID: {
        struct fake_device *d = k->to;
        return parse_bus_id(val, &d->domain, &d->bus, &d->dev, &d->func);
    }
    case V_CC: {
        struct fake_device *d = k->to;
        return sscanf(val, "%d.%d", &d->cc_major, &d->cc_minor) == 2;
    }
    }
    return 0;
}

/* Reads tok[1..n), each KEY=VALUE, into `keys`: NULL, or what is wrong, in `words`. */
static const char *parse_keys(char **tok, int n, const struct key *keys, size_t n_keys,
                              const struct record_words *words)
{
    unsigned int given = 0; /* bit k: keys[k] (n_keys <= 32) */
    for (int i = 1; i < n; i++) {
        char *name = tok[i], *val = strchr(tok[i], '=');
        if (!val)
            return "token without '='";
        *val++ = '\0';
        size_t k = 0;
        while (k < n_keys && strcmp(keys[k].name, name))
            k++;
        if (k == n_keys)
            return words->unknown;
        if (!parse_value(&keys[k], val))
            return words->bad;
        given |= 1u << k;
        if (keys[k].seen)
            *keys[k].seen = 1;
    }
    for (size_t k = 0; k < n_keys; k++)
        if (keys[k].needed && !(given & 1u << k))
            return words->needs;
    return NULL;
}

static const struct record_words DEVICE_WORDS = {"unknown device key", "bad device value", NULL};
static const struct record_words PROCESS_WORDS = {"unknown process key", "bad process value",
                                                  "process needs device= and pid="};
static const struct record_words FAIL_WORDS = {"unknown fail key", "bad fail value",
                                               "fail needs symbol= and error="};

static const char *parse_device(struct fake_state *s, char **tok, int n)
{
    struct fake_device d;
    unsigned int index = s->n_devices;
    memset(&d, 0, sizeof d);
    d.present = 1;
    strcpy(d.name, "NVIDIA H100 80GB HBM3");
    d.total = 85520809984ULL;
    d.mig = -1;
    d.cc_major = 9;
    d.cc_minor = 0;
    d.brand = 14; /* NVML_BRAND_NVIDIA, what data-centre GPUs report */
    d.pci_device_id = 0x233010DE;
    d.pci_subsystem_id = 0x16C110DE;
    int have_uuid = 0, have_bus = 0;
    const struct key keys[] = {
        {"index", V_UINT, &index, 0, NULL, MAY},
        {"uuid", V_TEXT, d.uuid, sizeof d.uuid, &have_uuid, MAY},
        {"name", V_TEXT, d.name, sizeof d.name, NULL, MAY},
        {"total", V_U64, &d.total, 0, NULL, MAY},
        {"reserved", V_U64, &d.reserved, 0, NULL, MAY},
        {"unattributed", V_U64, &d.unattributed, 0, NULL, MAY},
        {"util_gpu", V_UINT, &d.util_gpu, 0, NULL, MAY},
        {"util_mem", V_UINT, &d.util_mem, 0, NULL, MAY},
        {"pci_bus_id", V_BUS_ID, &d, 0, &have_bus, MAY},
        {"mig", V_FLAG, &d.mig, 0, NULL, MAY},
        {"pci_device_id", V_UINT, &d.pci_device_id, 0, NULL, MAY},
        {"pci_subsystem_id", V_UINT, &d.pci_subsystem_id, 0, NULL, MAY},
        {"cc", V_CC, &d, 0, NULL, MAY},
        {"brand", V_INT, &d.brand, 0, NULL, MAY},
    };
    const char *wrong = parse_keys(tok, n, keys, sizeof keys / sizeof *keys, &DEVICE_WORDS);
    if (wrong)
        return wrong;
    if (index >= MAX_DEVICES)
        return "device index out of range";
    if (s->devices[index].present)
        return "duplicate device index";
    if (!have_uuid)
        snprintf(d.uuid, sizeof d.uuid, "GPU-00000000-0000-0000-0000-%012x", index);
    if (!have_bus)
        d.bus = 0x10 + index;
    set_bus_id(&d);
    s->devices[index] = d;
    s->n_devices++;
    return NULL;
}

static const char *parse_process(struct fake_state *s, char **tok, int n)
{
    struct fake_process p = {0, 0, NVML_VALUE_NOT_AVAILABLE, PROC_COMPUTE, 0, NO_INSTANCE,
                             NO_INSTANCE};
    if (s->n_processes == MAX_PROCESSES)
        return "too many processes";
    const struct key keys[] = {
        {"device", V_UINT, &p.device, 0, NULL, NEEDS},
        {"pid", V_UINT, &p.pid, 0, NULL, NEEDS},
        {"used", V_USED, &p.used, 0, NULL, MAY},
        {"type", V_TYPES, &p.types, 0, NULL, MAY},
        {"ghost", V_FLAG, &p.ghost, 0, NULL, MAY},
        {"gi", V_UINT, &p.gi, 0, NULL, MAY},
        {"ci", V_UINT, &p.ci, 0, NULL, MAY},
    };
    const char *wrong = parse_keys(tok, n, keys, sizeof keys / sizeof *keys, &PROCESS_WORDS);
    if (!wrong)
        s->processes[s->n_processes++] = p;
    return wrong;
}

static const char *parse_failure(struct fake_state *s, char **tok, int n)
{
    struct fake_failure f;
    memset(&f, 0, sizeof f);
    f.device = -1;
    if (s->n_failures == MAX_FAILURES)
        return "too many failures";
    const struct key keys[] = {
        {"symbol", V_NAME, f.symbol, sizeof f.symbol, NULL, NEEDS},
        {"error", V_NONZERO, &f.error, 0, NULL, NEEDS},
        {"device", V_INT, &f.device, 0, NULL, MAY},
        {"times", V_INT, &f.times, 0, NULL, MAY},
    };
    const char *wrong = parse_keys(tok, n, keys, sizeof keys / sizeof *keys, &FAIL_WORDS);
    if (wrong)
        return wrong;
    size_t len = strlen(f.symbol);
    if (f.symbol[len - 1] == '*') {
        f.symbol[len - 1] = '\0';
        f.prefix = 1;
    }
    s->failures[s->n_failures++] = f;
    return NULL;
}

static const char *parse_line(struct fake_state *s, char *line)
{
    char *tok[MAX_TOKENS];
    int n = tokenize(line, tok, MAX_TOKENS);
    if (n < 0)
        return "unterminated quote or too many tokens";
    if (n == 0)
        return NULL;
    if (!strcmp(tok[0], "driver_version") || !strcmp(tok[0], "nvml_version")) {
        char *dst = tok[0][0] == 'd' ? s->driver_version : s->nvml_version;
        if (n != 2 || !copy_value(dst, sizeof s->driver_version, tok[1]))
            return "bad version";
        return NULL;
    }
    if (!strcmp(tok[0], "cuda_version")) {
        if (n != 2 || !parse_int(tok[1], &s->cuda_version))
            return "bad cuda_version";
        return NULL;
    }
    if (!strcmp(tok[0], "device"))
        return parse_device(s, tok, n);
    if (!strcmp(tok[0], "process"))
        return parse_process(s, tok, n);
    if (!strcmp(tok[0], "fail"))
        return parse_failure(s, tok, n);
    return "unknown record";
}

static void parse_state(FILE *f, const char *path, struct fake_state *s)
{
    char *line = NULL;
    size_t cap = 0;
    unsigned int lineno = 0, skipped = 0, first_line = 0;
    const char *first_reason = NULL;

    memset(s, 0, sizeof *s);
    strcpy(s->driver_version, "550.54.15");
    strcpy(s->nvml_version, "12.550.54.15");
    s->cuda_version = 12040;
    while (getline(&line, &cap, f) >= 0) {
        lineno++;
        const char *why = parse_line(s, line);
        if (why) {
            if (!skipped++) {
                first_reason = why;
                first_line = lineno;
            }
        }
    }
    free(line);
    if (skipped)
        fprintf(stderr, "fake-nvml: %s:%u: %s; skipped %u unreadable line(s) in all\n", path,
                first_line, first_reason, skipped);
}

static int same_identity(const struct file_identity *a, const struct stat *st)
{
    return a->valid && a->dev == st->st_dev && a->ino == st->st_ino && a->size == st->st_size &&
           a->mtim.tv_sec == st->st_mtim.tv_sec && a->mtim.tv_nsec == st->st_mtim.tv_nsec &&
           a->ctim.tv_sec == st->st_ctim.tv_sec && a->ctim.tv_nsec == st->st_ctim.tv_nsec;
}

static int same_failure(const struct fake_failure *a, const struct fake_failure *b)
{
    return a->prefix == b->prefix && a->error == b->error && a->device == b->device &&
           a->times == b->times && strcmp(a->symbol, b->symbol) == 0;
}

/* A counted failure record that the new state holds again keeps the count it had, so a rewrite
 * of the file for another reason does not re-arm a spent fault.  Equal records are paired in
 * order: the first new one with the first old one, and so on. */
static void carry_fail_counts(const struct fake_state *old, struct fake_state *new_state)
{
    unsigned char taken[MAX_FAILURES] = {0};
    for (unsigned int i = 0; i < new_state->n_failures; i++) {
        struct fake_failure *f = &new_state->failures[i];
        if (f->times <= 0)
            continue;
        for (unsigned int j = 0; j < old->n_failures; j++) {
            if (!taken[j] && same_failure(f, &old->failures[j])) {
                taken[j] = 1;
                f->used = old->failures[j].used;
                break;
            }
        }
    }
}

/* Forgets every record's pidfd: a new state's PID may name another process. */
static void close_pidfds(void)
{
    for (unsigned int i = 0; i < MAX_PROCESSES; i++) {
        if (g_pidfd_state[i] == PIDFD_OPEN)
            close(g_pidfd[i]);
        g_pidfd_state[i] = PIDFD_UNTRIED;
    }
    g_pidfds_open = 0;
    g_swept_at = 0;
}

/* Re-reads the state file if it changed.  Returns whether a state file is there now.
 * Called with g_lock held. */
static int refresh_locked(void)
{
    const char *path = getenv("GPUWATCH_FAKE_NVML_STATE");
    struct stat st;
    if (!path || !*path || stat(path, &st) != 0)
        return 0;
    if (same_identity(&g_seen, &st))
        return 1;
    FILE *f = fopen(path, "r");
    if (!f)
        return 0;
    /* Identify what was actually read: the file may have been replaced since stat(). */
    if (fstat(fileno(f), &st) != 0) {
        fclose(f);
        return 0;
    }
    parse_state(f, path, &g_scratch);
    fclose(f);
    carry_fail_counts(&g_state, &g_scratch);
    memcpy(&g_state, &g_scratch, sizeof g_state);
    memset(g_alive_at, 0, sizeof g_alive_at);
    close_pidfds();
    g_seen.valid = 1;
    g_seen.dev = st.st_dev;
    g_seen.ino = st.st_ino;
    g_seen.size = st.st_size;
    g_seen.mtim = st.st_mtim;
    g_seen.ctim = st.st_ctim;
    g_loaded = 1;
    return 1;
}

/* ---- process liveness ----------------------------------------------------------------------- */

/* Reads a small /proc file whole into buf, NUL-terminated: its length, or -1. Open, one read,
 * close: such a file is one read, and stdio would add two system calls. */
static ssize_t read_small(const char *path, char *buf, size_t size)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    ssize_t n = read(fd, buf, size - 1);
    close(fd);
    if (n <= 0)
        return -1;
    buf[n] = '\0';
    return n;
}

/* 1: the task runs (any state but zombie/dead), 0: zombie or dead, -1: no such task. */
static int task_alive(const char *stat_path)
{
    char buf[512];
    if (read_small(stat_path, buf, sizeof buf) < 0)
        return -1;
    /* The command name may itself contain ')' or spaces; the state follows the last ')'. */
    char *p = strrchr(buf, ')');
    if (!p || p[1] != ' ' || !p[2])
        return -1;
    return p[2] != 'Z' && p[2] != 'X';
}

/* Whether the driver would still charge memory to this PID.  A zombie thread-group leader keeps
 * the group's GPU contexts while any other thread of the group still runs. */
static int pid_holds_memory(unsigned int pid)
{
    char path[96];
    snprintf(path, sizeof path, "/proc/%u/stat", pid);
    int alive = task_alive(path);
    if (alive != 0)
        return alive == 1;

    snprintf(path, sizeof path, "/proc/%u/task", pid);
    DIR *dir = opendir(path);
    if (!dir)
        return 0;
    int held = 0;
    struct dirent *e;
    while (!held && (e = readdir(dir)) != NULL) {
        char *end;
        unsigned long tid = strtoul(e->d_name, &end, 10);
        if (e->d_name[0] < '0' || e->d_name[0] > '9' || *end || tid == pid)
            continue;
        snprintf(path, sizeof path, "/proc/%u/task/%lu/stat", pid, tid);
        held = task_alive(path) == 1;
    }
    closedir(dir);
    return held;
}

static unsigned long long monotonic_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (unsigned long long)ts.tv_sec * 1000000000ULL + (unsigned long long)ts.tv_nsec;
}

/* The PID /proc gives the process of a pidfd (the "Pid:" line of its fdinfo), -1 if none. The
 * two can disagree where /proc was mounted for another PID namespace than the caller's. */
static long pidfd_proc_pid(int fd)
{
    char path[64], buf[1024];
    snprintf(path, sizeof path, "/proc/self/fdinfo/%d", fd);
    if (read_small(path, buf, sizeof buf) < 0)
        return -1;
    char *line = strstr(buf, "\nPid:");
    return line ? strtol(line + 5, NULL, 10) : -1;
}

/* A pidfd on record i's process, kept while the state lasts; PIDFD_NONE where there is none to
 * be had (no pidfd_open before Linux 5.3, no such process, a PID that is not a process's, a
 * /proc that names the process otherwise) or where it would take more than a quarter of the
 * caller's descriptors: /proc is read for that record instead. */
static void open_pidfd(unsigned int i, unsigned int pid)
{
    g_pidfd_state[i] = PIDFD_NONE;
#ifdef SYS_pidfd_open
    struct rlimit limit;
    if (getrlimit(RLIMIT_NOFILE, &limit) != 0 ||
        (limit.rlim_cur != RLIM_INFINITY && g_pidfds_open >= limit.rlim_cur / 4))
        return;
    int fd = (int)syscall(SYS_pidfd_open, (pid_t)pid, 0);
    if (fd < 0)
        return;
    if (pidfd_proc_pid(fd) != (long)pid) {
        close(fd);
        return;
    }
    g_pidfd[i] = fd;
    g_pidfd_state[i] = PIDFD_OPEN;
    g_pidfds_open++;
#else
    (void)pid;
#endif
}

/* Reads the liveness of every record that has (or can now have) a pidfd, in one poll(): a
 * pidfd turns readable once its whole thread group has exited, so a zombie leader whose other
 * threads run still holds memory, as with the real driver. */
static void sweep_pidfds(unsigned long long now)
{
    unsigned int n = 0;
    for (unsigned int i = 0; i < g_state.n_processes; i++) {
        const struct fake_process *p = &g_state.processes[i];
        if (p->ghost)
            continue;
        if (g_pidfd_state[i] == PIDFD_UNTRIED)
            open_pidfd(i, p->pid);
        if (g_pidfd_state[i] != PIDFD_OPEN)
            continue;
        g_pollfds[n].fd = g_pidfd[i];
        g_pollfds[n].events = POLLIN;
        g_pollfds[n].revents = 0;
        g_polled[n++] = i;
    }
    g_swept_at = now;
    if (n == 0)
        return;
    int ready;
    do
        ready = poll(g_pollfds, n, 0);
    while (ready < 0 && errno == EINTR);
    for (unsigned int k = 0; k < n; k++) {
        unsigned int i = g_polled[k];
        if (ready < 0) { /* cannot happen with valid descriptors; /proc answers instead */
            close(g_pidfd[i]);
            g_pidfds_open--;
            g_pidfd_state[i] = PIDFD_NONE;
            continue;
        }
        int exited = (g_pollfds[k].revents & (POLLIN | POLLHUP | POLLERR | POLLNVAL)) != 0;
        if (exited && pid_holds_memory(g_state.processes[i].pid)) {
            /* /proc says it runs: the descriptor is not this process's pidfd any more (the
             * caller closed it, and the number went to a file of its own) or the PID names
             * another process now. Either way /proc answers for the record from now on, as it
             * did before pidfds; the descriptor is left to whoever holds it. */
            g_pidfds_open--;
            g_pidfd_state[i] = PIDFD_NONE;
            g_alive[i] = 1;
        } else {
            g_alive[i] = (unsigned char)!exited;
        }
        g_alive_at[i] = now;
    }
}

/* Called with g_lock held; `p` is a record of g_state. */
static int process_listed(const struct fake_process *p)
{
    if (p->ghost)
        return 1;
    size_t i = (size_t)(p - g_state.processes);
    unsigned long long now = monotonic_ns();
    if (g_alive_at[i] != 0 && now - g_alive_at[i] < LIVENESS_NS)
        return g_alive[i];
    if (g_pidfd_state[i] != PIDFD_NONE && (g_swept_at == 0 || now - g_swept_at >= LIVENESS_NS)) {
        sweep_pidfds(now ? now : 1);
        if (g_pidfd_state[i] == PIDFD_OPEN)
            return g_alive[i];
    }
    g_alive[i] = (unsigned char)pid_holds_memory(p->pid);
    g_alive_at[i] = now ? now : 1;
    return g_alive[i];
}

/* ---- entry protocol ------------------------------------------------------------------------- */

static int slot_index(const void *handle)
{
    uintptr_t p = (uintptr_t)handle, base = (uintptr_t)g_slots;
    if (p < base || p >= base + sizeof g_slots)
        return -1;
    return (int)((p - base) / sizeof g_slots[0]);
}

static nvmlReturn_t injected_failure(const char *symbol, int device)
{
    for (unsigned int i = 0; i < g_state.n_failures; i++) {
        struct fake_failure *f = &g_state.failures[i];
        if (f->device >= 0 && f->device != device)
            continue;
        if (f->times > 0 && f->used >= f->times)
            continue; /* a transient fault that has run its course */
        if (f->prefix ? strncmp(symbol, f->symbol, strlen(f->symbol)) == 0
                      : strcmp(symbol, f->symbol) == 0) {
            if (f->times > 0)
                f->used++;
            return f->error;
        }
    }
    return NVML_SUCCESS;
}

/* Takes g_lock, refreshes the state and consults the fail table, then requires an initialised
 * library.  On success the lock is held and must be released with leave(). */
static nvmlReturn_t enter(const char *symbol, int device)
{
    pthread_mutex_lock(&g_lock);
    refresh_locked();
    nvmlReturn_t r = injected_failure(symbol, device);
    if (r == NVML_SUCCESS && g_refcount == 0)
        r = NVML_ERROR_UNINITIALIZED;
    if (r != NVML_SUCCESS)
        pthread_mutex_unlock(&g_lock);
    return r;
}

static nvmlReturn_t leave(nvmlReturn_t r)
{
    pthread_mutex_unlock(&g_lock);
    return r;
}

/* enter(), for a call that writes its answer through pointers: `given` says whether they all
 * are (NVML_ERROR_INVALID_ARGUMENT, the lock left, where one is NULL). */
static nvmlReturn_t enter_writing(const char *symbol, int device, int given)
{
    nvmlReturn_t r = enter(symbol, device);
    if (r == NVML_SUCCESS && !given)
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    return r;
}

/* enter_writing() for calls on a device handle; *out is the device the handle names. */
static nvmlReturn_t enter_device(const char *symbol, nvmlDevice_t handle, int given,
                                 const struct fake_device **out)
{
    int index = slot_index(handle);
    nvmlReturn_t r = enter(symbol, index);
    if (r != NVML_SUCCESS)
        return r;
    if (index < 0 || !g_state.devices[index].present || !given)
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    *out = &g_state.devices[index];
    return NVML_SUCCESS;
}

static nvmlReturn_t copy_out(char *dst, unsigned int length, const char *src)
{
    if (!dst)
        return NVML_ERROR_INVALID_ARGUMENT;
    size_t n = strlen(src);
    if (n + 1 > length)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(dst, src, n + 1);
    return NVML_SUCCESS;
}

/* ---- init, shutdown, errors ----------------------------------------------------------------- */

static nvmlReturn_t init_common(const char *symbol)
{
    pthread_mutex_lock(&g_lock);
    int present = refresh_locked();
    nvmlReturn_t r = injected_failure(symbol, -1);
    if (r == NVML_SUCCESS && !present)
        r = NVML_ERROR_DRIVER_NOT_LOADED;
    if (r == NVML_SUCCESS)
        g_refcount++;
    return leave(r);
}

FAKE_API nvmlReturn_t nvmlInit(void)
{
    return init_common("nvmlInit");
}

FAKE_API nvmlReturn_t nvmlInit_v2(void)
{
    return init_common("nvmlInit_v2");
}

FAKE_API nvmlReturn_t nvmlInitWithFlags(unsigned int flags)
{
    (void)flags; /* NO_GPUS / NO_ATTACH change nothing for a driver without hardware */
    return init_common("nvmlInitWithFlags");
}

FAKE_API nvmlReturn_t nvmlShutdown(void)
{
    nvmlReturn_t r = enter("nvmlShutdown", -1);
    if (r != NVML_SUCCESS)
        return r;
    g_refcount--;
    if (g_refcount == 0) { /* the real library closes its descriptors too */
        close_pidfds();
        memset(g_alive_at, 0, sizeof g_alive_at);
    }
    return leave(NVML_SUCCESS);
}

FAKE_API const char *nvmlErrorString(nvmlReturn_t result)
{
    switch (result) {
    case 0: return "Success";
    case 1: return "Uninitialized";
    case 2: return "Invalid Argument";
    case 3: return "Not Supported";
    case 4: return "Insufficient Permissions";
    case 5: return "Already Initialized";
    case 6: return "Not Found";
    case 7: return "Insufficient Size";
    case 8: return "Insufficient External Power";
    case 9: return "Driver Not Loaded";
    case 10: return "Timeout";
    case 11: return "Interrupt Request Issue";
    case 12: return "NVML Shared Library Not Found";
    case 13: return "Function Not Found";
    case 14: return "Corrupted infoROM";
    case 15: return "GPU is lost";
    case 16: return "GPU requires restart";
    case 17: return "The operating system has blocked the request.";
    case 18: return "RM has detected an NVML/RM version mismatch.";
    case 19: return "In use by another client";
    case 20: return "Insufficient Memory";
    case 21: return "No data";
    case 22: return "The requested vgpu operation is not available on target device, because ECC is enabled";
    case 23: return "Insufficient Resources";
    case 24: return "Frequency not supported";
    case 25: return "Argument version mismatch";
    case 26: return "Deprecated";
    case 27: return "Not Ready";
    case 28: return "GPU not found";
    case 29: return "Invalid state";
    case 30: return "Reset type not supported";
    default: return "Unknown Error";
    }
}

/* ---- system --------------------------------------------------------------------------------- */

FAKE_API nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length)
{
    nvmlReturn_t r = enter("nvmlSystemGetDriverVersion", -1);
    if (r != NVML_SUCCESS)
        return r;
    return leave(copy_out(version, length, g_state.driver_version));
}

FAKE_API nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length)
{
    nvmlReturn_t r = enter("nvmlSystemGetNVMLVersion", -1);
    if (r != NVML_SUCCESS)
        return r;
    return leave(copy_out(version, length, g_state.nvml_version));
}

static nvmlReturn_t cuda_version(const char *symbol, int *version)
{
    nvmlReturn_t r = enter_writing(symbol, -1, version != NULL);
    if (r != NVML_SUCCESS)
        return r;
    *version = g_state.cuda_version;
    return leave(NVML_SUCCESS);
}

FAKE_API nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *version)
{
    return cuda_version("nvmlSystemGetCudaDriverVersion", version);
}

FAKE_API nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *version)
{
    return cuda_version("nvmlSystemGetCudaDriverVersion_v2", version);
}

/* ---- device enumeration --------------------------------------------------------------------- */

static nvmlReturn_t device_count(const char *symbol, unsigned int *count)
{
    nvmlReturn_t r = enter_writing(symbol, -1, count != NULL);
    if (r != NVML_SUCCESS)
        return r;
    *count = g_state.n_devices;
    return leave(NVML_SUCCESS);
}

FAKE_API nvmlReturn_t nvmlDeviceGetCount(unsigned int *count)
{
    return device_count("nvmlDeviceGetCount", count);
}

FAKE_API nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count)
{
    return device_count("nvmlDeviceGetCount_v2", count);
}

/* A handle lookup is a call aimed at the device it resolves to, so "fail ... device=N" entries
 * (a lost GPU) apply to it as they do on a real node. */
static nvmlReturn_t handle_for(const char *symbol, int index, nvmlDevice_t *device)
{
    nvmlReturn_t r = enter(symbol, index);
    if (r != NVML_SUCCESS)
        return r;
    if (!device || index < 0 || !g_state.devices[index].present)
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    *device = &g_slots[index];
    return leave(NVML_SUCCESS);
}

FAKE_API nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t *device)
{
    return handle_for("nvmlDeviceGetHandleByIndex", index < MAX_DEVICES ? (int)index : -1,
                      device);
}

FAKE_API nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device)
{
    return handle_for("nvmlDeviceGetHandleByIndex_v2", index < MAX_DEVICES ? (int)index : -1,
                      device);
}

/* Index of the device a lookup key names: -1 if none, -2 if the key is malformed. */
static int find_by_uuid_locked(const char *uuid)
{
    if (!uuid)
        return -2;
    for (int i = 0; i < MAX_DEVICES; i++)
        if (g_state.devices[i].present && strcmp(g_state.devices[i].uuid, uuid) == 0)
            return i;
    return -1;
}

static int find_by_bus_id_locked(const char *bus_id)
{
    unsigned int domain, bus, dev, func;
    if (!bus_id || !parse_bus_id(bus_id, &domain, &bus, &dev, &func))
        return -2;
    for (int i = 0; i < MAX_DEVICES; i++) {
        const struct fake_device *d = &g_state.devices[i];
        if (d->present && d->domain == domain && d->bus == bus && d->dev == dev &&
            d->func == func)
            return i;
    }
    return -1;
}

static nvmlReturn_t handle_by_key(const char *symbol, const char *key, int by_uuid,
                                  nvmlDevice_t *device)
{
    pthread_mutex_lock(&g_lock);
    refresh_locked();
    int index = by_uuid ? find_by_uuid_locked(key) : find_by_bus_id_locked(key);
    nvmlReturn_t r = injected_failure(symbol, index);
    if (r == NVML_SUCCESS && g_refcount == 0)
        r = NVML_ERROR_UNINITIALIZED;
    if (r == NVML_SUCCESS && (index == -2 || !device))
        r = NVML_ERROR_INVALID_ARGUMENT;
    if (r == NVML_SUCCESS && index == -1)
        r = NVML_ERROR_NOT_FOUND;
    if (r == NVML_SUCCESS)
        *device = &g_slots[index];
    return leave(r);
}

FAKE_API nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device)
{
    return handle_by_key("nvmlDeviceGetHandleByUUID", uuid, 1, device);
}

FAKE_API nvmlReturn_t nvmlDeviceGetHandleByPciBusId(const char *pciBusId, nvmlDevice_t *device)
{
    return handle_by_key("nvmlDeviceGetHandleByPciBusId", pciBusId, 0, device);
}

FAKE_API nvmlReturn_t nvmlDeviceGetHandleByPciBusId_v2(const char *pciBusId,
                                                       nvmlDevice_t *device)
{
    return handle_by_key("nvmlDeviceGetHandleByPciBusId_v2", pciBusId, 0, device);
}

/* ---- device identity ------------------------------------------------------------------------ */

/* A call that copies one of the device's strings, the one at `field` of its fake_device, out. */
static nvmlReturn_t device_text(const char *symbol, nvmlDevice_t device, char *out,
                                unsigned int length, size_t field)
{
    const struct fake_device *d;
    nvmlReturn_t r = enter_device(symbol, device, 1, &d);
    if (r != NVML_SUCCESS)
        return r;
    return leave(copy_out(out, length, (const char *)d + field));
}

FAKE_API nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length)
{
    return device_text("nvmlDeviceGetName", device, name, length,
                       offsetof(struct fake_device, name));
}

FAKE_API nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length)
{
    return device_text("nvmlDeviceGetUUID", device, uuid, length,
                       offsetof(struct fake_device, uuid));
}

/* What a call on a device answers through its one pointer (not NULL), under the lock. */
typedef nvmlReturn_t (*device_answer_fn)(const struct fake_device *d, void *out);

/* A call on a device handle that answers through one pointer, `out`: NVML_ERROR_INVALID_ARGUMENT
 * for a NULL one, else what `answer` says, having written there. */
static nvmlReturn_t device_answer(const char *symbol, nvmlDevice_t device, void *out,
                                  device_answer_fn answer)
{
    const struct fake_device *d;
    nvmlReturn_t r = enter_device(symbol, device, out != NULL, &d);
    if (r != NVML_SUCCESS)
        return r;
    return leave(answer(d, out));
}

static nvmlReturn_t index_of(const struct fake_device *d, void *index)
{
    *(unsigned int *)index = (unsigned int)(d - g_state.devices);
    return NVML_SUCCESS;
}

FAKE_API nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index)
{
    return device_answer("nvmlDeviceGetIndex", device, index, index_of);
}

/* /dev/nvidiaN: the minor number equals the index on a node without hidden GPUs. */
FAKE_API nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t device, unsigned int *minorNumber)
{
    return device_answer("nvmlDeviceGetMinorNumber", device, minorNumber, index_of);
}

FAKE_API nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *pci)
{
    const struct fake_device *d;
    nvmlReturn_t r = enter_device("nvmlDeviceGetPciInfo_v3", device, pci != NULL, &d);
    if (r != NVML_SUCCESS)
        return r;
    memset(pci, 0, sizeof *pci);
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, "%04X:%02X:%02X.%X", d->domain & 0xFFFF,
             d->bus, d->dev, d->func);
    pci->domain = d->domain;
    pci->bus = d->bus;
    pci->device = d->dev;
    pci->pciDeviceId = d->pci_device_id;
    pci->pciSubSystemId = d->pci_subsystem_id;
    memcpy(pci->busId, d->bus_id, sizeof pci->busId);
    return leave(NVML_SUCCESS);
}

static nvmlReturn_t pci_info_legacy(const char *symbol, nvmlDevice_t device,
                                    nvmlPciInfo_v2_t *pci)
{
    const struct fake_device *d;
    nvmlReturn_t r = enter_device(symbol, device, pci != NULL, &d);
    if (r != NVML_SUCCESS)
        return r;
    memset(pci, 0, sizeof *pci);
    snprintf(pci->busId, sizeof pci->busId, "%04X:%02X:%02X.%X", d->domain & 0xFFFF, d->bus,
             d->dev, d->func);
    pci->domain = d->domain;
    pci->bus = d->bus;
    pci->device = d->dev;
    pci->pciDeviceId = d->pci_device_id;
    pci->pciSubSystemId = d->pci_subsystem_id;
    return leave(NVML_SUCCESS);
}

FAKE_API nvmlReturn_t nvmlDeviceGetPciInfo(nvmlDevice_t device, nvmlPciInfo_v2_t *pci)
{
    return pci_info_legacy("nvmlDeviceGetPciInfo", device, pci);
}

FAKE_API nvmlReturn_t nvmlDeviceGetPciInfo_v2(nvmlDevice_t device, nvmlPciInfo_v2_t *pci)
{
    return pci_info_legacy("nvmlDeviceGetPciInfo_v2", device, pci);
}

FAKE_API nvmlReturn_t nvmlDeviceGetCudaComputeCapability(nvmlDevice_t device, int *major,
                                                         int *minor)
{
    const struct fake_device *d;
    nvmlReturn_t r = enter_device("nvmlDeviceGetCudaComputeCapability", device,
                                  major && minor, &d);
    if (r != NVML_SUCCESS)
        return r;
    *major = d->cc_major;
    *minor = d->cc_minor;
    return leave(NVML_SUCCESS);
}

static nvmlReturn_t brand_of(const struct fake_device *d, void *type)
{
    *(int *)type = d->brand;
    return NVML_SUCCESS;
}

FAKE_API nvmlReturn_t nvmlDeviceGetBrand(nvmlDevice_t device, int *type)
{
    return device_answer("nvmlDeviceGetBrand", device, type, brand_of);
}

FAKE_API nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t device, unsigned int *currentMode,
                                           unsigned int *pendingMode)
{
    const struct fake_device *d;
    nvmlReturn_t r = enter_device("nvmlDeviceGetMigMode", device, 1, &d);
    if (r != NVML_SUCCESS)
        return r;
    if (d->mig < 0)
        return leave(NVML_ERROR_NOT_SUPPORTED);
    if (!currentMode || !pendingMode)
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    *currentMode = *pendingMode = (unsigned int)d->mig;
    return leave(NVML_SUCCESS);
}

static nvmlReturn_t utilization_of(const struct fake_device *d, void *out)
{
    nvmlUtilization_t *utilization = out;
    utilization->gpu = d->util_gpu;
    utilization->memory = d->util_mem;
    return NVML_SUCCESS;
}

FAKE_API nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device,
                                                    nvmlUtilization_t *utilization)
{
    return device_answer("nvmlDeviceGetUtilizationRates", device, utilization, utilization_of);
}

/* ---- memory --------------------------------------------------------------------------------- */

/* Memory in use by live (or ghost) processes plus what nobody accounts for; excludes reserved. */
static unsigned long long used_locked(const struct fake_device *d)
{
    unsigned int index = (unsigned int)(d - g_state.devices);
    unsigned long long used = d->unattributed;
    for (unsigned int i = 0; i < g_state.n_processes; i++) {
        const struct fake_process *p = &g_state.processes[i];
        if (p->device == index && p->used != NVML_VALUE_NOT_AVAILABLE && process_listed(p))
            used += p->used;
    }
    return used;
}

static unsigned long long free_of(unsigned long long total, unsigned long long taken)
{
    return taken >= total ? 0 : total - taken;
}

/* The v1 structure has no reserved field: reserved memory is counted as used. */
static nvmlReturn_t memory_v1(const struct fake_device *d, void *out)
{
    nvmlMemory_t *memory = out;
    unsigned long long used = used_locked(d) + d->reserved;
    memory->total = d->total;
    memory->used = used;
    memory->free = free_of(d->total, used);
    return NVML_SUCCESS;
}

FAKE_API nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory)
{
    return device_answer("nvmlDeviceGetMemoryInfo", device, memory, memory_v1);
}

static nvmlReturn_t memory_v2(const struct fake_device *d, void *out)
{
    nvmlMemory_v2_t *memory = out;
    if (memory->version != nvmlMemory_v2)
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    unsigned long long used = used_locked(d);
    memory->total = d->total;
    memory->reserved = d->reserved;
    memory->used = used;
    memory->free = free_of(d->total, used + d->reserved);
    return NVML_SUCCESS;
}

FAKE_API nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory)
{
    return device_answer("nvmlDeviceGetMemoryInfo_v2", device, memory, memory_v2);
}

/* ---- process lists -------------------------------------------------------------------------- */

/* The count-then-fill protocol: with no room (infos NULL or *count too small) report the
 * number needed and INSUFFICIENT_SIZE, except that an empty list is a plain SUCCESS. */
static nvmlReturn_t list_processes(const char *symbol, nvmlDevice_t device, unsigned int *count,
                                   void *infos, unsigned int types, int v1_layout)
{
    const struct fake_device *d;
    nvmlReturn_t r = enter_device(symbol, device, count != NULL, &d);
    if (r != NVML_SUCCESS)
        return r;
    unsigned int index = (unsigned int)(d - g_state.devices), n = 0;
    for (unsigned int i = 0; i < g_state.n_processes; i++) {
        const struct fake_process *p = &g_state.processes[i];
        if (p->device == index && (p->types & types) && process_listed(p))
            g_matched[n++] = i;
    }
    if (n == 0) {
        *count = 0;
        return leave(NVML_SUCCESS);
    }
    if (!infos || *count < n) {
        *count = n;
        return leave(NVML_ERROR_INSUFFICIENT_SIZE);
    }
    for (unsigned int k = 0; k < n; k++) {
        const struct fake_process *p = &g_state.processes[g_matched[k]];
        if (v1_layout) {
            nvmlProcessInfo_v1_t *out = (nvmlProcessInfo_v1_t *)infos + k;
            out->pid = p->pid;
            out->usedGpuMemory = p->used;
        } else {
            nvmlProcessInfo_v2_t *out = (nvmlProcessInfo_v2_t *)infos + k;
            out->pid = p->pid;
            out->usedGpuMemory = p->used;
            out->gpuInstanceId = p->gi;
            out->computeInstanceId = p->ci;
        }
    }
    *count = n;
    return leave(NVML_SUCCESS);
}

#define PROCESS_LIST(name, types, v1)                                                          \
    FAKE_API nvmlReturn_t name(nvmlDevice_t device, unsigned int *infoCount, void *infos)      \
    {                                                                                          \
        return list_processes(#name, device, infoCount, infos, types, v1);                     \
    }

PROCESS_LIST(nvmlDeviceGetComputeRunningProcesses, PROC_COMPUTE, 1)
PROCESS_LIST(nvmlDeviceGetComputeRunningProcesses_v2, PROC_COMPUTE, 0)
PROCESS_LIST(nvmlDeviceGetComputeRunningProcesses_v3, PROC_COMPUTE, 0)
PROCESS_LIST(nvmlDeviceGetGraphicsRunningProcesses, PROC_GRAPHICS, 1)
PROCESS_LIST(nvmlDeviceGetGraphicsRunningProcesses_v2, PROC_GRAPHICS, 0)
PROCESS_LIST(nvmlDeviceGetGraphicsRunningProcesses_v3, PROC_GRAPHICS, 0)
/* The simulated node runs no MPS server: these lists are always empty. */
PROCESS_LIST(nvmlDeviceGetMPSComputeRunningProcesses, 0, 1)
PROCESS_LIST(nvmlDeviceGetMPSComputeRunningProcesses_v2, 0, 0)
PROCESS_LIST(nvmlDeviceGetMPSComputeRunningProcesses_v3, 0, 0)

/* ---- everything else ------------------------------------------------------------------------ */

/*
 * Every other symbol pynvml can look up exists, answering NOT_SUPPORTED once initialised (and
 * after the fail table), the way a real driver answers for a feature the GPU lacks.  Which
 * symbols exist matters: nvitop, for one, picks its process-info layout from the presence of
 * nvmlDeviceGetConfComputeMemSizeInfo and nvmlDeviceGetRunningProcessDetailList.
 *
 * Each stub is defined with a single pointer parameter whatever its real prototype.  On the
 * x86-64 System V and AArch64 (AAPCS64) ABIs arguments travel in registers and the caller removes
 * any it pushed, so a callee that reads only its first integer register is harmless.  That value
 * is only compared with the handle array (to match "fail ... device=N" entries), never
 * dereferenced, so a first argument that is not a device handle is harmless too.
 */
static nvmlReturn_t stub_call(const char *symbol, const void *first_arg)
{
    nvmlReturn_t r = enter(symbol, slot_index(first_arg));
    if (r != NVML_SUCCESS)
        return r;
    return leave(NVML_ERROR_NOT_SUPPORTED);
}

#define FAKE_NVML_STUB(name)                                                                   \
    FAKE_API nvmlReturn_t name(const void *first_arg)                                          \
    {                                                                                          \
        return stub_call(#name, first_arg);                                                    \
    }
#include "fake_nvml_symbols.h"
#undef FAKE_NVML_STUB
