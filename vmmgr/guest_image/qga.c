/* A minimal QEMU guest agent for vmmgr's built-in guest: the JSON protocol of qemu-ga on the
 * virtio-serial port org.qemu.guest_agent.0, with just what libvirt needs to hibernate a guest:
 *   guest-sync / guest-sync-delimited  answer with the id (libvirt's handshake)
 *   guest-ping, guest-info             {}
 *   guest-suspend-disk                 no answer (as qemu-ga): swap on, then S4 through
 *                                      /sys/power/state; the kernel writes its image to swap
 *                                      and powers off, and after a resume we carry on here.
 * Usage: qga PORT_DEVICE SWAP_DEVICE
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/swap.h>
#include <unistd.h>

static int port;

static void reply(const char *json) {
    if (write(port, json, strlen(json)) < 0 || write(port, "\n", 1) < 0)
        perror("qga: write");
}

/* Returns only when the hibernation failed (or after a resume, when the kernel has restored
 * the image and this write returns 0): the caller answers the failure as an error, as qemu-ga. */
static int hibernate(const char *swap, char *why, size_t size) {
    if (swapon(swap, 0) < 0 && errno != EBUSY) {
        snprintf(why, size, "swapon %s: %s", swap, strerror(errno));
        return -1;
    }
    int fd = open("/sys/power/state", O_WRONLY);
    if (fd < 0 || write(fd, "disk", 4) != 4) {
        snprintf(why, size, "/sys/power/state: %s", strerror(errno));
        if (fd >= 0)
            close(fd);
        return -1;
    }
    close(fd);
    return 0;
}

static void handle(const char *line, const char *swap) {
    char out[128];
    const char *id = strstr(line, "\"id\"");
    if (strstr(line, "\"guest-sync")) {
        long long value = 0;
        if (id && (id = strchr(id, ':')))
            value = atoll(id + 1);
        if (strstr(line, "guest-sync-delimited"))
            write(port, "\xff", 1);
        snprintf(out, sizeof out, "{\"return\": %lld}", value);
        reply(out);
    } else if (strstr(line, "\"guest-ping\"") || strstr(line, "\"guest-info\"")) {
        reply("{\"return\": {}}");
    } else if (strstr(line, "\"guest-suspend-disk\"")) {
        char why[256], msg[512];
        if (hibernate(swap, why, sizeof why) < 0) {
            snprintf(msg, sizeof msg,
                     "{\"error\": {\"class\": \"GenericError\", \"desc\": \"%s\"}}", why);
            reply(msg);
        }
    } else if (strstr(line, "\"execute\"")) {
        reply("{\"error\": {\"class\": \"CommandNotFound\", \"desc\": \"not in vmmgr's agent\"}}");
    }
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: qga PORT_DEVICE SWAP_DEVICE\n");
        return 2;
    }
    port = open(argv[1], O_RDWR);
    if (port < 0) {
        perror("qga: open port");
        return 1;
    }
    char line[4096];
    size_t len = 0;
    for (;;) {
        char c;
        ssize_t n = read(port, &c, 1);
        if (n <= 0) { /* the host side is not connected (yet, or any more): wait for it */
            usleep(200000);
            continue;
        }
        if (c == '\xff') { /* a delimiter: libvirt resets the stream with it */
            len = 0;
            continue;
        }
        if (len < sizeof line - 1)
            line[len++] = c;
        /* A command ends with its closing brace at depth 0; count braces to find it. */
        int depth = 0;
        for (size_t i = 0; i < len; i++)
            depth += (line[i] == '{') - (line[i] == '}');
        if (depth == 0 && memchr(line, '{', len)) {
            line[len] = 0;
            handle(line, argv[2]);
            len = 0;
        } else if (depth == 0) {
            len = 0; /* whitespace between commands */
        }
    }
}
