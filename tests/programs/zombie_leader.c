/*
 * A process whose thread-group leader has exited while another thread lives on, as when a
 * trainer's main thread returns but NCCL's heartbeat thread still holds the GPU context.
 *
 * It prints its PID, starts the second thread, and the main thread calls pthread_exit(NULL):
 * /proc/PID/stat then shows the leader as 'Z' while /proc/PID/status says "Threads: 2".
 * SIGTERM or SIGINT ends the whole process with status 0; SIGKILL ends it as usual.
 */
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

static void on_signal(int signum)
{
    (void)signum;
    _exit(0); /* exit_group: the lingering thread goes too */
}

static void *heartbeat(void *arg)
{
    (void)arg;
    for (;;)
        pause();
    return NULL;
}

int main(void)
{
    struct sigaction sa;
    pthread_t thread;

    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    /* Installed before the thread exists and before the PID is announced: whoever reads the
     * PID may signal at once. */
    if (sigaction(SIGTERM, &sa, NULL) != 0 || sigaction(SIGINT, &sa, NULL) != 0) {
        perror("sigaction");
        return 1;
    }
    if (pthread_create(&thread, NULL, heartbeat, NULL) != 0) {
        fputs("pthread_create failed\n", stderr);
        return 1;
    }
    printf("%d\n", (int)getpid());
    fflush(stdout);
    pthread_exit(NULL);
}
