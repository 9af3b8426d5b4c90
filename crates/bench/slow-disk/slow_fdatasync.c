/* slow_fdatasync.c: a slow disk for `estop bench`, without touching estop's code.
 *
 * Preloaded into a process (LD_PRELOAD), it sleeps SLOW_FDATASYNC_US microseconds after every
 * fdatasync(2) returns, as a disk whose cache flush takes that much longer would. `estop bench`
 * passes its environment on to the daemon it starts, so the raw probes and the daemon see the
 * same slower disk in the same run (see docs/PERFORMANCE.md, "What bounds 64 connections on a
 * slow disk"). fsync(2) (snapshots, preallocation) is left alone.
 *
 *   gcc -shared -fPIC -O2 -o /tmp/slow_fdatasync.so crates/bench/slow-disk/slow_fdatasync.c -ldl
 *   LD_PRELOAD=/tmp/slow_fdatasync.so SLOW_FDATASYNC_US=200 target/release/estop bench
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdlib.h>
#include <time.h>

static int (*real_fdatasync)(int);
static long delay_us;

__attribute__((constructor)) static void init(void) {
    real_fdatasync = (int (*)(int))dlsym(RTLD_NEXT, "fdatasync");
    const char *e = getenv("SLOW_FDATASYNC_US");
    delay_us = e ? atol(e) : 0;
}

int fdatasync(int fd) {
    int r = real_fdatasync(fd);
    if (delay_us > 0) {
        struct timespec ts = {delay_us / 1000000, (delay_us % 1000000) * 1000};
        nanosleep(&ts, NULL);
    }
    return r;
}
