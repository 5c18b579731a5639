/*
 * stream: a deterministic byte stream for network tests, the same on the guest and the host.
 *
 *   stream MIB RATE_MIB_S
 *
 * Writes MIB MiB of xorshift64 output to stdout at RATE MiB/s (0 = as fast as it can), then
 * exits. The sender and the checker run the same static binary, so the checker knows the
 * stream's SHA-256 without the stream ever being stored.
 */
#include <stdint.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#define CHUNK 65536

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

int main(int argc, char **argv) {
    if (argc != 3) return 2;
    uint64_t total = strtoull(argv[1], 0, 10) * 1024 * 1024;
    double rate = atof(argv[2]) * 1024 * 1024;
    static uint64_t buf[CHUNK / 8];
    uint64_t x = 0x9E3779B97F4A7C15ULL, sent = 0;
    double start = now();
    while (sent < total) {
        for (int i = 0; i < CHUNK / 8; i++) {
            x ^= x << 13; x ^= x >> 7; x ^= x << 17;
            buf[i] = x;
        }
        size_t n = total - sent < CHUNK ? total - sent : CHUNK;
        for (size_t off = 0; off < n;) {
            ssize_t w = write(1, (char *)buf + off, n - off);
            if (w <= 0) return 1;
            off += w;
        }
        sent += n;
        if (rate > 0) {
            double ahead = sent / rate - (now() - start);
            if (ahead > 0) usleep((useconds_t)(ahead * 1e6));
        }
    }
    return 0;
}
