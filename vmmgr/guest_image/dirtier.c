/*
 * dirtier: the built-in guest's memory-pressure workload.
 *
 *   dirtier RATE_MIB_S WORKING_SET_MIB
 *
 * Rewrites a working set of W MiB at R MiB/s (0 = as fast as it can), page by page, in passes.
 * Every page holds a pattern derived from (page number, pass); before a page is rewritten its old
 * content is checked against the pattern it must hold, so any page a migration lost or corrupted is
 * caught on the next pass. Prints one status line a second and "CORRUPT ..." on any mismatch.
 * The expected state is just (pass, cursor): page i holds pass+1 if i < cursor, else pass.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#define PAGE 4096
#define WORDS (PAGE / sizeof(uint64_t))

static uint64_t pattern(uint64_t page, uint64_t pass, uint64_t word) {
    return (page * 0x100000001B3ULL) ^ (pass * 0x9E3779B97F4A7C15ULL) ^ (word << 40) ^ 0x5A5A;
}

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

static void fill(uint64_t *p, uint64_t page, uint64_t pass) {
    for (uint64_t w = 0; w < WORDS; w++) p[w] = pattern(page, pass, w);
}

int main(int argc, char **argv) {
    double rate = argc > 1 ? atof(argv[1]) : 0;
    uint64_t mib = argc > 2 ? strtoull(argv[2], 0, 10) : 16;
    uint64_t pages = mib * 1024 * 1024 / PAGE;
    uint64_t *mem = mmap(0, pages * PAGE, PROT_READ | PROT_WRITE,
                         MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    if (mem == MAP_FAILED) {
        printf("dirtier: cannot map %llu MiB\n", (unsigned long long)mib);
        return 1;
    }
    for (uint64_t i = 0; i < pages; i++) fill(mem + i * WORDS, i, 0);
    printf("dirtier start rate=%g MiB/s working_set=%llu MiB\n", rate, (unsigned long long)mib);
    fflush(stdout);

    uint64_t pass = 0, cursor = 0, corrupt = 0, written = 0, written_at_report = 0;
    double start = now(), last_report = start;
    const double slice = 0.01; /* pace in 10 ms slices */
    uint64_t per_slice = rate > 0 ? (uint64_t)(rate * 1024 * 1024 / PAGE * slice) : pages;
    if (per_slice == 0) per_slice = 1;
    double next_slice = start;
    for (;;) {
        for (uint64_t n = 0; n < per_slice; n++) {
            uint64_t *p = mem + cursor * WORDS;
            for (uint64_t w = 0; w < WORDS; w++) {
                if (p[w] != pattern(cursor, pass, w)) {
                    corrupt++;
                    printf("CORRUPT page %llu word %llu pass %llu: found %016llx expected %016llx\n",
                           (unsigned long long)cursor, (unsigned long long)w,
                           (unsigned long long)pass, (unsigned long long)p[w],
                           (unsigned long long)pattern(cursor, pass, w));
                    fflush(stdout);
                    break;
                }
            }
            fill(p, cursor, pass + 1);
            written++;
            if (++cursor == pages) {
                cursor = 0;
                pass++;
            }
        }
        double t = now();
        if (t - last_report >= 1.0) {
            double mibs = (written - written_at_report) * (double)PAGE / (1024 * 1024) / (t - last_report);
            printf("dirtier t=%.0f pass=%llu rate=%.1f MiB/s corrupt=%llu\n", t - start,
                   (unsigned long long)pass, mibs, (unsigned long long)corrupt);
            fflush(stdout);
            last_report = t;
            written_at_report = written;
        }
        if (rate > 0) {
            next_slice += slice;
            double wait = next_slice - now();
            if (wait > 0) {
                struct timespec ts = {(time_t)wait, (long)((wait - (time_t)wait) * 1e9)};
                nanosleep(&ts, 0);
            } else if (wait < -1.0) {
                next_slice = now(); /* fell behind (throttled): do not burst to catch up */
            }
        }
    }
}
