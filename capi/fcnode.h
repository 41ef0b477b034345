/*
 * fcnode.h -- the client side of the node socket protocol (nodesock/nodesock.go), shared by
 * the hit path of libfitcache (capi/hitpath.c) and the preload shim (preload/): constants
 * and the small helpers both need. Header-only (static functions), so that each library
 * keeps its own private copy.
 */
#ifndef FITCACHE_NODE_H
#define FITCACHE_NODE_H

#include <errno.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

#define FC_NODE_MAGIC "FCN1"
#define FC_NODE_OP_FETCH 1
#define FC_NODE_OP_OPEN 2
#define FC_NODE_OP_FORGET 3
#define FC_NODE_MAX_MESSAGE 1000

static inline void fc_put32(uint8_t *p, uint32_t v) {
	p[0] = (uint8_t)v;
	p[1] = (uint8_t)(v >> 8);
	p[2] = (uint8_t)(v >> 16);
	p[3] = (uint8_t)(v >> 24);
}

static inline uint32_t fc_get32(const uint8_t *p) {
	return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* Sends n bytes (no SIGPIPE): 0, or -1 with errno set. */
static inline int fc_send_all(int fd, const void *p, size_t n) {
	while (n > 0) {
		ssize_t k = send(fd, p, n, MSG_NOSIGNAL);
		if (k < 0 && errno == EINTR)
			continue;
		if (k <= 0)
			return -1;
		p = (const char *)p + k;
		n -= (size_t)k;
	}
	return 0;
}

/* Receives n bytes: 0, or -1 with errno set (EAGAIN when the receive timeout passed,
 * ECONNRESET when the server closed the connection). */
static inline int fc_recv_all(int fd, void *p, size_t n) {
	while (n > 0) {
		ssize_t k = recv(fd, p, n, 0);
		if (k < 0 && errno == EINTR)
			continue;
		if (k == 0)
			errno = ECONNRESET; // closed by the server: not a timeout, whatever errno held
		if (k <= 0)
			return -1;
		p = (char *)p + k;
		n -= (size_t)k;
	}
	return 0;
}

/* Connects to the node socket at addr, with timeout_ms on sends and receives: the
 * connection, or -1 with errno set. */
static inline int fc_node_connect(const struct sockaddr_un *addr, int64_t timeout_ms) {
	int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (fd < 0)
		return -1;
	struct timeval tv = {.tv_sec = timeout_ms / 1000, .tv_usec = (timeout_ms % 1000) * 1000};
	setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
	setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
	if (connect(fd, (const struct sockaddr *)addr, sizeof *addr) != 0) {
		int err = errno;
		close(fd);
		errno = err;
		return -1;
	}
	return fd;
}

#endif /* FITCACHE_NODE_H */
