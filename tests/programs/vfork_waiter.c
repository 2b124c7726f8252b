/* A process in uninterruptible sleep (state D), made without privileges: after vfork() the
 * parent waits in the kernel, unable to run, until its child calls exec or exits. The child
 * sleeps for the number of seconds given (default 600), so the parent stays in D that long, as a
 * process stuck in a driver call or on a hung file system does. Prints the parent's PID. Killing
 * the parent with SIGKILL ends the wait (it is a killable one); kill the process group to end
 * both. */
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

int main(int argc, char **argv) {
    unsigned seconds = argc > 1 ? (unsigned)atoi(argv[1]) : 600;
    printf("%d\n", (int)getpid());
    fflush(stdout);
    pid_t child = vfork();
    if (child == 0) {
        /* POSIX allows only exec or _exit here; Linux also runs a bare system call, which is
         * all sleep() makes, while the parent's memory stays untouched. */
        sleep(seconds);
        _exit(0);
    }
    return child < 0 ? 1 : 0;
}
