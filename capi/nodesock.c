// Requests to the node's server over its node socket (package nodesock, capi/fcnode.h): the
// connections a client keeps for its process's misses, a fetch into the tiers (node_fetch),
// requests without a reply (node_tell), and an open answered with a descriptor
// (node_open_read).
#define _GNU_SOURCE
#include "hitclient.h"

#include "fcnode.h"

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

// node_connect opens a connection to a node socket (see fc_node_connect).
int node_connect(const char *socket_path, int64_t timeout_ms) {
	struct sockaddr_un addr = {.sun_family = AF_UNIX};
	strcpy(addr.sun_path, socket_path);
	return fc_node_connect(&addr, timeout_ms);
}

// node_up reports whether c has a node socket that is not being skipped (node_down_until).
bool node_up(const struct hit_client *c) {
	return node_path(c)[0] && fc_monotonic_ns() >= __atomic_load_n(&c->node_down_until, __ATOMIC_RELAXED);
}

// node_take returns one of the connections to the node socket that c keeps for this process's
// misses (struct node_conn) that no other thread uses, or -1 when it has none open yet (the
// caller connects, and node_give keeps the connection); *kept is then the connection's place
// + 1, and node_give must follow. With every place taken, *kept is 0 and -1 is returned: the
// thread connects on its own. A connection inherited through fork is the parent's: it is
// closed, never used.
int node_take(struct hit_client *c, int *kept) {
	for (int k = 0; k < NODE_CONNS; k++) {
		struct node_conn *n = &c->node_conns[k];
		if (pthread_mutex_trylock(&n->mu) != 0)
			continue;
		if (n->fd >= 0 && n->pid != getpid()) {
			close(n->fd);
			n->fd = -1;
		}
		*kept = k + 1;
		return n->fd;
	}
	*kept = 0;
	return -1;
}

// node_give ends what node_take began: fd (a connection whose last exchange went through, or
// -1) is kept for the next miss, or closed when it was a thread's own.
void node_give(struct hit_client *c, int fd, int kept) {
	if (kept) {
		struct node_conn *n = &c->node_conns[kept - 1];
		n->fd = fd;
		n->pid = getpid();
		pthread_mutex_unlock(&n->mu);
	} else if (fd >= 0) {
		close(fd);
	}
}

// closing returns the descriptor that tells c's misses to stop waiting (see closing_fd), or
// -1 in a process that did not open c.
int closing(const struct hit_client *c) { return c->opener == getpid() ? c->closing_fd : -1; }

// node_ask sends one fetch request (op FC_NODE_OP_FETCH or FC_NODE_OP_FETCH_BLOCK) on fd and
// reads the reply: 0 with the server's errno in *err and its message in msg, or -1 with errno
// set when the connection failed (EAGAIN: the server did not acknowledge within the probe
// time, stopped acknowledging, or did not answer within timeout_ms; ECANCELED: the client is
// being closed, cancel_fd).
static int node_ask(int fd, uint32_t op, const char *root, size_t rootlen, const char *path, size_t len,
                    int64_t timeout_ms, int cancel_fd, int32_t *err, char *msg) {
	uint8_t reply[12];
	if (fc_node_request(fd, op, root, rootlen, path, len, timeout_ms, cancel_fd) != 0 ||
	    fc_recv_all(fd, reply, sizeof reply) != 0)
		return -1;
	if (memcmp(reply, FC_NODE_MAGIC, 4) != 0 || fc_get32(reply + 8) > FC_NODE_MAX_MESSAGE ||
	    fc_recv_all(fd, msg, fc_get32(reply + 8)) != 0) {
		errno = EPROTO;
		return -1;
	}
	msg[fc_get32(reply + 8)] = 0;
	*err = (int32_t)fc_get32(reply + 4);
	return 0;
}

// node_tell sends c's server a request it does not answer (FC_NODE_OP_CACHE_BLOCK,
// FC_NODE_OP_RECORD), on a connection kept for this process's misses, or on one of its own
// when other threads have them all: a request without a reply leaves the kept connection
// ready for the next. It returns 0 when the request was sent, else -1.
int node_tell(struct hit_client *c, uint32_t op, const char *name, size_t len) {
	if (!node_up(c))
		return -1;
	int kept, fd = node_take(c, &kept), sent = 0, timed_out = 0;
	// A kept connection the server closed (idle) fails: once more on a new one.
	for (int attempt = 0; attempt < 2 && !sent && !timed_out; attempt++) {
		if (fd < 0 && (fd = node_connect(node_path(c), c->timeout_ms)) < 0) {
			timed_out = errno == EAGAIN || errno == EWOULDBLOCK;
			break;
		}
		sent = fc_node_send_request(fd, op, c->root, c->rootlen, name, len) == 0;
		if (!sent) {
			timed_out = errno == EAGAIN || errno == EWOULDBLOCK;
			close(fd);
			fd = -1;
		}
	}
	node_give(c, fd, kept);
	if (timed_out) // a hung server: skip it for a while
		__atomic_store_n(&c->node_down_until, fc_monotonic_ns() + NODE_BACKOFF_NS, __ATOMIC_RELAXED);
	return sent ? 0 : -1;
}

// node_fetch asks c's server, over its node socket, to bring the file or block named name
// (len bytes) into its tiers (op FC_NODE_OP_FETCH or FC_NODE_OP_FETCH_BLOCK), waiting a second
// at most for the server to acknowledge the request and no longer than the client's read
// timeout for its answer. Returns 0 when the file is cached now (read_cached finds it),
// FC_NO_TIER when no tier takes it (after the server said it has no room for the dataset,
// without asking for FULL_RECHECK_NS), FC_MISS when there is no node socket or no server
// listening, FC_UNAVAILABLE when the server did not answer in time (the node socket is then
// skipped for NODE_BACKOFF_NS), or the file's own negated errno (-ENOENT...), with the
// server's message in msg (FC_FETCH_MESSAGE bytes, always terminated). The caller holds a
// reference to c.
int node_fetch(struct hit_client *c, uint32_t op, const char *name, size_t len, char *msg) {
	if (!node_up(c))
		return FC_MISS;
	if (fc_monotonic_ns() < __atomic_load_n(&c->full_until, __ATOMIC_RELAXED))
		return FC_NO_TIER; // the server said it has no room for this dataset: do not ask again yet
	// Connections are kept for the misses of this process (node_take), one per thread at a
	// time. A connection that failed is never used again (a late reply would be taken for the next
	// request's); a broken kept one (the server restarted) is replaced once.
	int kept;
	int fd = node_take(c, &kept);
	int32_t err = 0;
	int asked = -1, timed_out = 0, canceled = 0;
	for (int attempt = 0; attempt < 2 && asked != 0 && !timed_out && !canceled; attempt++) {
		if (fd < 0 && (fd = node_connect(node_path(c), c->timeout_ms)) < 0)
			break; // no server listening: Go starts one
		asked = node_ask(fd, op, c->root, c->rootlen, name, len, c->timeout_ms, closing(c), &err, msg);
		if (asked != 0) {
			timed_out = errno == EAGAIN || errno == EWOULDBLOCK;
			canceled = errno == ECANCELED; // closed: Go says so (the handle is gone)
			close(fd);
			fd = -1;
		}
	}
	node_give(c, fd, kept);
	int rc = FC_MISS; // for anything but a timeout: Go handles it (starts a server, say)
	if (timed_out) { // a hung server: skip it for a while
		__atomic_store_n(&c->node_down_until, fc_monotonic_ns() + NODE_BACKOFF_NS, __ATOMIC_RELAXED);
		rc = FC_UNAVAILABLE;
	} else if (asked == 0 && err == 0) {
		rc = 0;
		__atomic_fetch_add(&c->fetches, 1, __ATOMIC_RELAXED);
	} else if (asked == 0 && (err == EFBIG || err == ENOSPC)) {
		rc = FC_NO_TIER; // no tier takes it: read the source
		if (err == ENOSPC) // none takes any more file of this dataset (see tiers.Tier.MakeRoom)
			__atomic_store_n(&c->full_until, fc_monotonic_ns() + FULL_RECHECK_NS, __ATOMIC_RELAXED);
	} else if (asked == 0 && err != EBADF && err != ETIMEDOUT && err != EIO) {
		rc = -err; // the file's own error; for the others, Go reads it
	}
	return rc;
}

// node_open_read asks c's node socket to open the clean path clean (n bytes;
// FC_NODE_OP_OPEN) and reads what the descriptor it answers with holds, as fc_read hands files
// out; 0, FC_MISS when it cannot ask (Go reads the file and says why), FC_UNAVAILABLE when
// the server did not answer in time, or the file's own negated errno. The caller holds a
// reference to c.
int node_open_read(struct hit_client *c, const char *clean, size_t n, const void **data, int64_t *size,
                   int64_t *buffer) {
	int saved = errno;
	int rc = FC_MISS, sock = -1, fd = -1;
	if (!node_path(c)[0])
		goto out;
	// On a connection kept for this process's misses, as node_fetch asks (a connection per
	// open cost the server an accepted connection and a new goroutine per file, and the
	// reader a connect): one that failed is closed, a broken kept one replaced once.
	int kept, asked = -1, timed_out = 0, canceled = 0;
	int32_t err = 0;
	uint32_t origin; // whatever the descriptor holds, its bytes are the file's
	sock = node_take(c, &kept);
	for (int attempt = 0; attempt < 2 && asked != 0 && !timed_out && !canceled; attempt++) {
		if (sock < 0 && (sock = node_connect(node_path(c), c->timeout_ms)) < 0)
			break;
		asked = fc_node_request(sock, FC_NODE_OP_OPEN, c->root, c->rootlen, clean, n, c->timeout_ms,
		                        closing(c)) == 0 &&
		                fc_node_recv_open(sock, &fd, &err, &origin) == 0
		            ? 0
		            : -1;
		if (asked != 0) {
			timed_out = errno == EAGAIN || errno == EWOULDBLOCK;
			canceled = errno == ECANCELED;
			close(sock);
			sock = -1;
		}
	}
	node_give(c, sock, kept);
	sock = -1;
	if (asked != 0) {
		if (timed_out) {
			__atomic_store_n(&c->node_down_until, fc_monotonic_ns() + NODE_BACKOFF_NS, __ATOMIC_RELAXED);
			rc = FC_UNAVAILABLE;
		}
		goto out;
	}
	if (err != 0) {
		rc = err != EBADF && err != ETIMEDOUT && err != EIO ? -err : FC_MISS;
		goto out;
	}
	struct stat st;
	if (fc_sys_fstat(fd, &st) != 0 || !S_ISREG(st.st_mode))
		goto out;
	struct fc_hit h = {.fd = fd, .size = st.st_size};
	void *ptr;
	uint8_t kind;
	if ((rc = take(&h, &ptr, &kind)) != 0 || (rc = hand_out(ptr, h.size, kind, data, size, buffer)) != 0)
		goto out;
	__atomic_fetch_add(&c->fetches, 1, __ATOMIC_RELAXED);
out:
	if (fd >= 0)
		close(fd);
	if (sock >= 0)
		close(sock);
	errno = saved;
	return rc;
}
