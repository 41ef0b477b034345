// Batches of opens: the misses of a client whose node's server opens them (cluster mode),
// asked for in one request per FC_NODE_MAX_BATCH files (FC_NODE_OP_OPEN_MANY), the bytes of
// small files inline in the answer.
#define _GNU_SOURCE
#include "hitclient.h"

#include "fcnode.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

// After the node's server closed a batch request unacknowledged (a server older than
// FC_NODE_OP_OPEN_MANY), a client asks for each file alone for this long, then tries a batch
// again (a newer server may have taken the older one's place).
#define BATCH_RECHECK_NS (60 * 1000000000LL)

// opened_read reads the file of one answer to an open request (fd, or the server's errno err)
// as fc_read hands files out, and closes fd; it returns as node_open_read does (FC_MISS for
// what Go is to read and explain).
static int opened_read(struct hit_client *c, int fd, int32_t err, const void **data, int64_t *size, int64_t *buffer) {
	int rc = FC_MISS;
	struct stat st;
	if (err != 0) {
		rc = err != EBADF && err != ETIMEDOUT && err != EIO && err != ENOSYS ? -err : FC_MISS;
	} else if (fc_sys_fstat(fd, &st) == 0 && S_ISREG(st.st_mode)) {
		struct fc_hit h = {.fd = fd, .size = st.st_size};
		void *ptr;
		uint8_t kind;
		if ((rc = take(&h, &ptr, &kind)) == 0 && (rc = hand_out(ptr, h.size, kind, data, size, buffer)) == 0)
			__atomic_fetch_add(&c->fetches, 1, __ATOMIC_RELAXED);
	}
	if (fd >= 0)
		close(fd);
	return rc;
}

// recv_batch_reply reads the reply for one file of an FC_NODE_OP_OPEN_MANY request on sock:
// an open reply (see fc_node_recv_open) with the inline length after the message length, then
// the message and, unless that length is FC_NODE_INLINE_NONE, that many bytes of the file,
// read into memory the hit path hands out (*ptr, *kind; checked against FC_NODE_MAX_INLINE
// first). Returns 0 with the server's errno in *err and *fd (or -1 for inline bytes), or -1
// with errno set when the connection failed or the reply was malformed (nothing is held then).
static int recv_batch_reply(int sock, int *fd, int32_t *err, void **ptr, int64_t *n, uint8_t *kind) {
	uint8_t reply[20];
	*ptr = NULL;
	*n = 0;
	*kind = BUF_EMPTY;
	int ok = fc_node_recv_head(sock, reply, sizeof reply, fd) == 0;
	uint32_t inline_len = ok ? fc_get32(reply + 16) : 0;
	*err = ok ? (int32_t)fc_get32(reply + 4) : 0;
	if (ok && (memcmp(reply, FC_NODE_MAGIC, 4) != 0 || fc_get32(reply + 12) > FC_NODE_MAX_MESSAGE ||
	           (inline_len != FC_NODE_INLINE_NONE && (inline_len > FC_NODE_MAX_INLINE || *fd >= 0 || *err != 0)) ||
	           (inline_len == FC_NODE_INLINE_NONE && *fd < 0 && *err == 0))) { // no bytes at all
		errno = EPROTO;
		ok = 0;
	}
	char message[FC_NODE_MAX_MESSAGE];
	if (ok && fc_recv_all(sock, message, fc_get32(reply + 12)) != 0)
		ok = 0;
	if (ok && inline_len != FC_NODE_INLINE_NONE) {
		*n = inline_len;
		*kind = inline_len ? BUF_HEAP : BUF_EMPTY;
		if (inline_len && !(*ptr = buf_alloc(inline_len))) {
			errno = ENOMEM;
			ok = 0;
		} else if (inline_len && fc_recv_all(sock, *ptr, inline_len) != 0) {
			buf_free(*ptr, inline_len);
			*ptr = NULL;
			ok = 0;
		}
	}
	if ((!ok || *err != 0) && *fd >= 0) {
		close(*fd);
		*fd = -1;
	}
	return ok ? 0 : -1;
}

// open_batch sends one FC_NODE_OP_OPEN_MANY request for the m paths listed in list (len bytes)
// on *sock, a connection kept for c's misses or -1, and reads the answer for file asked[j]
// into its slot of data, sizes, buffers and results (see opened_read). A connection that fails
// is closed (*sock is -1 then), and a broken kept one replaced once. It returns 0 when the
// server answered, FC_ASK_ALONE when it does not know the operation (it closed a connection of
// its own unacknowledged), FC_UNAVAILABLE when it did not answer in time, FC_MISS otherwise;
// the files without an answer then have that result.
static int open_batch(struct hit_client *c, int *sock, const char *list, size_t len, const int *asked, int m,
                      const void **data, int64_t *sizes, int64_t *buffers, int *results) {
	int sent = -1, err = 0, rc = 0, j = 0;
	for (int attempt = 0; attempt < 2 && sent != 0; attempt++) {
		int fresh = *sock < 0, acked = 0;
		if (*sock < 0 && (*sock = node_connect(node_path(c), c->timeout_ms)) < 0) {
			err = errno;
			break;
		}
		uint8_t ack[4];
		fc_set_rcvtimeo(*sock, fc_node_probe_ms(c->timeout_ms));
		errno = EPROTO;
		if (fc_node_send_request(*sock, FC_NODE_OP_OPEN_MANY, c->root, c->rootlen, list, len) == 0 &&
		    fc_recv_all(*sock, ack, sizeof ack) == 0) {
			acked = memcmp(ack, FC_NODE_ACK, sizeof ack) == 0;
			errno = EPROTO;
			sent = acked ? fc_node_await_reply(*sock, c->timeout_ms, closing(c)) : -1;
		}
		if (sent == 0)
			break;
		err = errno;
		close(*sock);
		*sock = -1;
		if (fresh && !acked && (err == ECONNRESET || err == EPIPE)) {
			err = ENOSYS; // an unknown operation: a server older than batches
			break;
		}
		if (err == EAGAIN || err == EWOULDBLOCK || err == ECANCELED)
			break;
	}
	for (; sent == 0 && j < m; j++) {
		int i = asked[j], fd;
		int32_t ferr;
		void *ptr;
		int64_t n;
		uint8_t kind = BUF_EMPTY;
		if (recv_batch_reply(*sock, &fd, &ferr, &ptr, &n, &kind) != 0) {
			err = errno;
			close(*sock);
			*sock = -1;
			break;
		}
		if (ferr != 0 || fd >= 0) {
			results[i] = opened_read(c, fd, ferr, &data[i], &sizes[i], &buffers[i]);
		} else if ((results[i] = hand_out(ptr, n, kind, &data[i], &sizes[i], &buffers[i])) == 0) {
			__atomic_fetch_add(&c->fetches, 1, __ATOMIC_RELAXED);
		}
	}
	if (j < m)
		rc = err == ENOSYS ? FC_ASK_ALONE : err == EAGAIN || err == EWOULDBLOCK ? FC_UNAVAILABLE : FC_MISS;
	for (; j < m; j++)
		results[asked[j]] = rc;
	return rc;
}

// node_open_many asks c's node's server to open the files paths[idx[j]] (j < n) of a batch
// (c->node_opens), in one round trip per FC_NODE_MAX_BATCH files. Each file's slot of data,
// sizes, buffers and results is set: results[i] is 0 (the file is handed out), the file's own
// negated errno, FC_MISS (Go reads it and says why), FC_UNAVAILABLE (the server did not
// answer in time: the node socket is skipped for a while), or FC_ASK_ALONE (not asked: ask for
// it alone, node_open_read; a server that does not know the operation is asked so for
// BATCH_RECHECK_NS). Returns how many are FC_ASK_ALONE. The caller holds a reference to c.
int node_open_many(struct hit_client *c, const char *const *paths, const int *idx, int n, const void **data,
                   int64_t *sizes, int64_t *buffers, int *results) {
	int saved = errno;
	for (int j = 0; j < n; j++) {
		int i = idx[j];
		data[i] = NULL;
		sizes[i] = 0;
		buffers[i] = 0;
		results[i] = FC_ASK_ALONE;
	}
	int64_t now = fc_monotonic_ns();
	// The paths of a request, each clean, under the root and followed by a NUL byte.
	size_t cap = (size_t)(n < FC_NODE_MAX_BATCH ? n : FC_NODE_MAX_BATCH) * (FC_PATH_MAX + 1);
	char *list = NULL;
	if (!c->node_opens || !node_path(c)[0] || now < __atomic_load_n(&c->node_down_until, __ATOMIC_RELAXED) ||
	    now < __atomic_load_n(&c->batch_off_until, __ATOMIC_RELAXED) || !(list = malloc(cap))) {
		errno = saved;
		return n;
	}
	int asked[FC_NODE_MAX_BATCH];
	int kept, sock = node_take(c, &kept), rc = 0, j = 0;
	while (j < n && rc == 0) {
		size_t len = 0;
		int m = 0;
		for (; j < n && m < FC_NODE_MAX_BATCH; j++) {
			int i = idx[j];
			int k = source_path(c, paths[i], list + len, FC_PATH_MAX);
			if (k < 0) {
				results[i] = FC_MISS; // Go says why
				continue;
			}
			list[len + (size_t)k] = 0;
			len += (size_t)k + 1;
			asked[m++] = i;
		}
		if (m > 0)
			rc = open_batch(c, &sock, list, len, asked, m, data, sizes, buffers, results);
	}
	for (; j < n; j++) // after a failed request: as its files
		results[idx[j]] = rc;
	node_give(c, sock, kept);
	if (rc == FC_ASK_ALONE)
		__atomic_store_n(&c->batch_off_until, fc_monotonic_ns() + BATCH_RECHECK_NS, __ATOMIC_RELAXED);
	if (rc == FC_UNAVAILABLE)
		__atomic_store_n(&c->node_down_until, fc_monotonic_ns() + NODE_BACKOFF_NS, __ATOMIC_RELAXED);
	free(list);
	errno = saved;
	int alone = 0;
	for (int j = 0; j < n; j++)
		alone += results[idx[j]] == FC_ASK_ALONE;
	return alone;
}
