/*
 * fcnode.h -- the client side of the node socket protocol (nodesock/nodesock.go), shared by
 * the hit path of libfitcache (capi/nodesock.c, openmany.c, miss.c) and the preload shim
 * (preload/): constants and the small helpers both need. Header-only (static functions), so
 * that each library keeps its own private copy.
 */
#ifndef FITCACHE_NODE_H
#define FITCACHE_NODE_H

#include <errno.h>
#include <poll.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/time.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "fclookup.h" /* fc_sys_close */

#define FC_NODE_MAGIC "FCN3"
#define FC_NODE_ACK "FCA3" /* sent by the server as soon as it has read a request, then every
                              quarter probe time until it replies */
#define FC_NODE_OP_FETCH 1
#define FC_NODE_OP_OPEN 2
#define FC_NODE_OP_FORGET 3
#define FC_NODE_OP_FETCH_BLOCK 4 /* the path is a block's name (tiers.BlockName) */
#define FC_NODE_OP_CACHE_BLOCK 5 /* as FETCH_BLOCK, answered with neither ack nor reply */
#define FC_NODE_OP_OPEN_MANY 6   /* OPEN for a batch: the path field lists paths, each followed by
                                    a NUL byte; one OPEN reply per path, in order */
#define FC_NODE_MAX_BATCH 128    /* paths in one FC_NODE_OP_OPEN_MANY request (nodesock.MaxBatch) */
#define FC_NODE_MAX_INLINE (512 << 10) /* bytes of a file sent inline in an OPEN_MANY reply
                                          (nodesock.MaxInline) */
#define FC_NODE_INLINE_NONE 0xFFFFFFFFu /* an OPEN_MANY reply's inline length: no bytes follow */
#define FC_NODE_OP_RECORD 7 /* a reader's fill (capi/fill.h): the path, a NUL byte and FC_NODE_RECORD_BYTES
                               of report; answered with neither ack nor reply */
#define FC_NODE_RECORD_BYTES 48
/* The report's mode field (offset 40): the source's mode bits, and flags. */
#define FC_NODE_RECORD_MODE_BITS 07777
#define FC_NODE_RECORD_HAS_CRC (1u << 16) /* the report's last 4 bytes hold the copy's CRC-32C */
#define FC_NODE_RECORD_CRC_OFFSET 44
#define FC_NODE_MAX_MESSAGE 1000

/* How long a client waits to connect, to send a request and for each ack (nodesock.ProbeTimeout):
 * a server that does not acknowledge within it is hung (stopped with SIGSTOP, say: the kernel
 * still accepts its connections), before the request or while it works on it; only a server
 * that keeps acknowledging is waited for up to the read timeout, which a large source file
 * may need. */
#define FC_NODE_PROBE_MS 1000

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

/* Sends one request: the 16-byte header (magic, op, root length, path length), the root and
 * the path, in one sendmsg when it takes them all. 0, or -1 with errno set. */
static inline int fc_node_send_request(int fd, uint32_t op, const char *root, size_t rootlen, const char *path,
                                       size_t len) {
	uint8_t hdr[16];
	memcpy(hdr, FC_NODE_MAGIC, 4);
	fc_put32(hdr + 4, op);
	fc_put32(hdr + 8, (uint32_t)rootlen);
	fc_put32(hdr + 12, (uint32_t)len);
	struct iovec iov[3] = {{hdr, sizeof hdr}, {(void *)root, rootlen}, {(void *)path, len}};
	struct msghdr msg = {.msg_iov = iov, .msg_iovlen = 3};
	ssize_t k;
	do
		k = sendmsg(fd, &msg, MSG_NOSIGNAL);
	while (k < 0 && errno == EINTR);
	if (k < 0)
		return -1;
	/* A short send (a full socket buffer): the rest, piece by piece. */
	size_t sent = (size_t)k;
	for (int i = 0; i < 3; i++) {
		if (sent >= iov[i].iov_len) {
			sent -= iov[i].iov_len;
			continue;
		}
		if (fc_send_all(fd, (const char *)iov[i].iov_base + sent, iov[i].iov_len - sent) != 0)
			return -1;
		sent = 0;
	}
	return 0;
}

/* Sets the receive timeout of fd to ms milliseconds (at least 1: 0 would mean none). */
static inline void fc_set_rcvtimeo(int fd, int64_t ms) {
	if (ms < 1)
		ms = 1;
	struct timeval tv = {.tv_sec = ms / 1000, .tv_usec = (ms % 1000) * 1000};
	setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
}

/* The probe time for a client whose read timeout is timeout_ms: FC_NODE_PROBE_MS, or the read
 * timeout when it is shorter. */
static inline int64_t fc_node_probe_ms(int64_t timeout_ms) {
	return timeout_ms < FC_NODE_PROBE_MS ? timeout_ms : FC_NODE_PROBE_MS;
}

static inline int64_t fc_node_now_ms(void) {
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Waits until the reply to a request begins on fd, taking in the acks that the server repeats
 * while it works on the request: 0 once other bytes than an ack are there (the reply's, left
 * unread, with a descriptor riding on them), or -1 with errno set: EAGAIN when neither an ack
 * nor the reply came within the probe time (a server stopped or hung while the request was in
 * flight) or the reply did not begin within timeout_ms, ECONNRESET when the server closed
 * the connection, ECANCELED when cancel_fd (-1 for none) became readable. Each ack is a write
 * of its own, so a peek of 4 bytes sees a whole ack or the reply's magic. */
static inline int fc_node_await_reply(int fd, int64_t timeout_ms, int cancel_fd) {
	int64_t now = fc_node_now_ms(), end = now + timeout_ms, alive = now;
	for (;;) {
		int64_t until = alive + fc_node_probe_ms(timeout_ms);
		if (until > end)
			until = end;
		if ((now = fc_node_now_ms()) >= until) {
			errno = EAGAIN;
			return -1;
		}
		struct pollfd p[2] = {{.fd = fd, .events = POLLIN}, {.fd = cancel_fd, .events = POLLIN}};
		int n = poll(p, cancel_fd >= 0 ? 2 : 1, (int)(until - now));
		if (n < 0 && errno != EINTR)
			return -1;
		if (n > 0 && cancel_fd >= 0 && p[1].revents) {
			errno = ECANCELED;
			return -1;
		}
		if (n <= 0)
			continue;
		uint8_t head[4];
		ssize_t k = recv(fd, head, sizeof head, MSG_PEEK | MSG_DONTWAIT);
		if (k == 0) {
			errno = ECONNRESET;
			return -1;
		}
		if (k < 0 && errno != EINTR && errno != EAGAIN && errno != EWOULDBLOCK)
			return -1;
		if (k < 0)
			continue;
		if (memcmp(head, FC_NODE_ACK, (size_t)k) != 0)
			return 0; /* the reply begins (or bytes the caller finds malformed) */
		if (k < (ssize_t)sizeof head) { /* the start of an ack or of the reply: wait for the rest */
			struct timespec pause = {.tv_nsec = 1000000};
			nanosleep(&pause, NULL);
			continue;
		}
		if (recv(fd, head, sizeof head, MSG_DONTWAIT) != (ssize_t)sizeof head)
			return -1;
		alive = fc_node_now_ms();
	}
}

/* Sends one request on fd (connected by fc_node_connect), waits for the server's ack for the
 * probe time of timeout_ms, then for its reply to begin while the server keeps acknowledging
 * (fc_node_await_reply, with cancel_fd), up to timeout_ms; the caller reads the reply, whose
 * bytes are there (the receive timeout is the probe time). 0, or -1 with errno set: EAGAIN
 * when no ack came in time (a hung server, before or during the request), ECONNRESET when the
 * server closed the connection, EPROTO for bytes that are not an ack, ECANCELED. */
static inline int fc_node_request(int fd, uint32_t op, const char *root, size_t rootlen, const char *path, size_t len,
                                  int64_t timeout_ms, int cancel_fd) {
	uint8_t ack[4];
	fc_set_rcvtimeo(fd, fc_node_probe_ms(timeout_ms));
	if (fc_node_send_request(fd, op, root, rootlen, path, len) != 0 || fc_recv_all(fd, ack, sizeof ack) != 0)
		return -1;
	if (memcmp(ack, FC_NODE_ACK, 4) != 0) {
		errno = EPROTO;
		return -1;
	}
	return fc_node_await_reply(fd, timeout_ms, cancel_fd);
}

/* Connects to the node socket at addr, with the probe time of timeout_ms on the connection
 * and on sends (a server whose backlog is full blocks connect, a stopped one with a full
 * socket buffer blocks send): the connection, or -1 with errno set. Use fc_node_request to
 * ask. The socket must be a path (an empty or abstract name
 * could be bound by any user of the node), and the server must run as this user or as root:
 * its answers are descriptors the program reads as dataset files. */
static inline int fc_node_connect(const struct sockaddr_un *addr, int64_t timeout_ms) {
	if (addr->sun_family != AF_UNIX || addr->sun_path[0] != '/') {
		errno = EINVAL;
		return -1;
	}
	int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (fd < 0)
		return -1;
	int64_t probe = fc_node_probe_ms(timeout_ms);
	struct timeval tv = {.tv_sec = probe / 1000, .tv_usec = (probe % 1000) * 1000};
	setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
	fc_set_rcvtimeo(fd, probe);
	int err = 0;
	struct ucred cred;
	socklen_t credlen = sizeof cred;
	if (connect(fd, (const struct sockaddr *)addr, sizeof *addr) != 0)
		err = errno;
	else if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &credlen) != 0)
		err = errno;
	else if (cred.uid != geteuid() && cred.uid != 0)
		err = EPERM;
	if (err) {
		fc_sys_close(fd);
		errno = err;
		return -1;
	}
	return fd;
}

/* What the descriptor of an open reply holds: core.Origin's values (nodesock's tests hold them
 * together). The shim acts on the two sources; every other origin is a whole copy. */
#define FC_ORIGIN_SOURCE 2              /* the source; no tier takes the file whole */
#define FC_ORIGIN_PEER 3                /* a memory file of the bytes another node's server sent */
#define FC_ORIGIN_SOURCE_WHILE_CACHED 4 /* the source of a large file while it is cached whole */
#define FC_ORIGIN_TIER_FIRST 8          /* a tier of this node: FC_ORIGIN_TIER_FIRST + its kind */

/* Returns the name of an FC_ORIGIN_ value, as core.Origin's String and the metrics' origin
 * labels give it ("memory", "source", ...), for diagnostics; a static string, never NULL. The
 * tier kinds are tiers.Kind's, in its order. */
static inline const char *fc_origin_name(uint32_t origin) {
	static const char *const names[] = {"none", "inflight", "source", "peer", "source-while-cached"};
	static const char *const tiers[] = {"memory", "pmem", "nvme", "disk"};
	if (origin < sizeof names / sizeof names[0])
		return names[origin];
	if (origin >= FC_ORIGIN_TIER_FIRST && origin - FC_ORIGIN_TIER_FIRST < sizeof tiers / sizeof tiers[0])
		return tiers[origin - FC_ORIGIN_TIER_FIRST];
	return "unknown";
}

/* Reads the n fixed bytes of a reply into head on sock, keeping in *fd the descriptor that
 * rides on the first of them (close-on-exec; -1 for none). Returns 0 once all n are read
 * (then *fd is the caller's), or -1 with errno set (ECONNRESET when the server closed the
 * connection), having closed a descriptor that came. */
static inline int fc_node_recv_head(int sock, uint8_t *head, size_t n, int *fd) {
	union {
		char buf[CMSG_SPACE(sizeof(int))];
		struct cmsghdr align;
	} control;
	struct iovec iov = {.iov_base = head, .iov_len = n};
	struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = control.buf, .msg_controllen = sizeof control.buf};
	ssize_t got;
	do
		got = recvmsg(sock, &msg, MSG_CMSG_CLOEXEC);
	while (got < 0 && errno == EINTR);
	*fd = -1;
	if (got <= 0) {
		if (got == 0)
			errno = ECONNRESET; /* closed by the server: not a timeout */
		return -1;
	}
	for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c))
		if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS && c->cmsg_len == CMSG_LEN(sizeof(int)))
			memcpy(fd, CMSG_DATA(c), sizeof *fd);
	if (msg.msg_flags & MSG_CTRUNC)
		errno = EPROTO;
	if ((msg.msg_flags & MSG_CTRUNC) || fc_recv_all(sock, head + got, n - (size_t)got) != 0) {
		if (*fd >= 0)
			fc_sys_close(*fd);
		*fd = -1;
		return -1;
	}
	return 0;
}

/* Reads the reply to an open request (FC_NODE_OP_OPEN) on sock: magic, errno, origin, message
 * length and message, with the descriptor riding on the first bytes. Returns 0 with the
 * server's errno in *err (0: success, and *fd holds the descriptor, close-on-exec, and *origin
 * what it holds, an FC_ORIGIN_ value), or -1 with errno set when the connection failed or the
 * reply was malformed. A descriptor that came with an error, or with a reply that could not
 * be read, is closed. */
static inline int fc_node_recv_open(int sock, int *fd, int32_t *err, uint32_t *origin) {
	uint8_t reply[16];
	int ok = fc_node_recv_head(sock, reply, sizeof reply, fd) == 0;
	if (ok && (memcmp(reply, FC_NODE_MAGIC, 4) != 0 || fc_get32(reply + 12) > FC_NODE_MAX_MESSAGE)) {
		errno = EPROTO;
		ok = 0;
	}
	char message[FC_NODE_MAX_MESSAGE];
	if (ok && fc_recv_all(sock, message, fc_get32(reply + 12)) != 0) /* the connection may serve again */
		ok = 0;
	*err = ok ? (int32_t)fc_get32(reply + 4) : 0;
	*origin = ok ? fc_get32(reply + 8) : 0;
	if ((!ok || *err != 0) && *fd >= 0) {
		fc_sys_close(*fd);
		*fd = -1;
	}
	return ok ? 0 : -1;
}

#endif /* FITCACHE_NODE_H */
