/* A wall-clock step for one process, as an NTP step or a wrong RTC gives it (benchmarks/chaos.py's clock_step,
 * tests/swarm/test_wall_clock.py).
 *
 * LD_PRELOAD'ed into a peer, it adds an offset (seconds, a decimal number) to CLOCK_REALTIME, gettimeofday and
 * time, and leaves CLOCK_MONOTONIC alone (a real step moves the wall clock only; asyncio's timers keep
 * going). The offset is read from the file named by LOCOMM_CLOCK_OFFSET_FILE, at most once per second of
 * monotonic time, with open/read (no stdio, no malloc: this runs inside any thread). A missing or empty file
 * means no offset. libfaketime was tried first: 0.9.10 fails Python's time.sleep with EINVAL when it leaves
 * the monotonic clock alone.
 *
 *     built by locomm/testing/wallclock.py: cc -shared -fPIC -O2 -o clock_step.so clock_step.c -ldl
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stdlib.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

typedef int (*clock_gettime_fn)(clockid_t, struct timespec *);

static clock_gettime_fn real_clock_gettime;
static volatile long long offset_ns;
static volatile long long next_read_ns;
static volatile int reading;

static long long mono_ns(void) {
    struct timespec t;
    real_clock_gettime(CLOCK_MONOTONIC, &t);
    return (long long)t.tv_sec * 1000000000LL + t.tv_nsec;
}

static void refresh(void) {
    long long now = mono_ns();
    if (now < next_read_ns || __sync_lock_test_and_set(&reading, 1)) return;
    next_read_ns = now + 1000000000LL;
    const char *path = getenv("LOCOMM_CLOCK_OFFSET_FILE");
    if (path != NULL) {
        int fd = open(path, O_RDONLY | O_CLOEXEC);
        if (fd >= 0) {
            char buf[64];
            ssize_t n = read(fd, buf, sizeof buf - 1);
            close(fd);
            if (n >= 0) {
                buf[n] = 0;
                offset_ns = n > 0 ? (long long)(strtod(buf, NULL) * 1e9) : 0;
            }
        }
    }
    __sync_lock_release(&reading);
}

static void shift(struct timespec *t) {
    long long ns = (long long)t->tv_sec * 1000000000LL + t->tv_nsec + offset_ns;
    t->tv_sec = ns / 1000000000LL;
    t->tv_nsec = ns % 1000000000LL;
}

static void init(void) {
    if (real_clock_gettime == NULL) real_clock_gettime = (clock_gettime_fn)dlsym(RTLD_NEXT, "clock_gettime");
}

int clock_gettime(clockid_t id, struct timespec *t) {
    init();
    int r = real_clock_gettime(id, t);
    if (r == 0 && (id == CLOCK_REALTIME || id == CLOCK_REALTIME_COARSE)) {
        refresh();
        shift(t);
    }
    return r;
}

int gettimeofday(struct timeval *restrict tv, void *restrict tz) {
    (void)tz;
    struct timespec t;
    int r = clock_gettime(CLOCK_REALTIME, &t);
    if (r == 0) {
        tv->tv_sec = t.tv_sec;
        tv->tv_usec = t.tv_nsec / 1000;
    }
    return r;
}

time_t time(time_t *out) {
    struct timespec t;
    clock_gettime(CLOCK_REALTIME, &t);
    if (out != NULL) *out = t.tv_sec;
    return t.tv_sec;
}
