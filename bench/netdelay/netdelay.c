/*
 * netdelay -- holds each packet of a netfilter queue for a fixed time, then lets it go: the
 * link delay of bench_cluster.py's network namespaces, on kernels built without netem (whose
 * `tc qdisc ... netem delay` would do it). tests/harness.py's NetnsNodes.shape sends a
 * namespace's outgoing packets to queue 0 (iptables NFQUEUE --queue-bypass) and runs one
 * netdelay per namespace.
 *
 *   netdelay QUEUE DELAY_US [PIDFILE]
 *
 * With PIDFILE it goes to the background once the queue is bound (so that no packet is
 * queued before it listens) and writes its pid there, with a newline, last; the file is
 * opened first, so that a bad path fails in the foreground. SIGTERM or SIGINT stop it, and
 * the packets still held go at once (the kernel would drop them when the queue closes).
 *
 * Every packet is held the same time, so they are let go in the order they came: the held
 * ones are a FIFO of packet ids, and one batch verdict accepts every id up to the last one
 * due. The kernel's queue holds as many packets as the FIFO, and lets packets through at once
 * when it is full (fail-open): late or early, never lost.
 *
 * Build: gcc -O2 -o netdelay netdelay.c -lnetfilter_queue -lnfnetlink
 * (Debian: apt-get install libnetfilter-queue-dev).
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <linux/netfilter.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/prctl.h>
#include <time.h>
#include <unistd.h>

#include <libnetfilter_queue/libnetfilter_queue.h>
#include <libnfnetlink/libnfnetlink.h>

// held is the FIFO of packets waiting: their ids and when each is due (CLOCK_MONOTONIC ns).
// first and next count packets ever held and let go; they wrap together. HELD_MAX is the
// kernel queue's length too.
#define HELD_MAX (1u << 18)
// DRAIN_MAX bounds the messages read between two looks at the clock, so that a burst does
// not hold packets past their time.
#define DRAIN_MAX 64
static struct {
	uint32_t id[HELD_MAX];
	uint64_t due[HELD_MAX];
	uint32_t first, next;
} held;

static uint64_t delay_ns;
static volatile sig_atomic_t stopping;

static uint64_t now_ns(void) {
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

// on_packet holds a packet the kernel queued.
static int on_packet(struct nfq_q_handle *q, struct nfgenmsg *msg, struct nfq_data *pkt, void *data) {
	(void)msg, (void)data;
	struct nfqnl_msg_packet_hdr *hdr = nfq_get_msg_packet_hdr(pkt);
	if (!hdr)
		return 0;
	uint32_t id = ntohl(hdr->packet_id);
	if (held.next - held.first == HELD_MAX) // cannot be: the kernel queue is as long; never lose it
		return nfq_set_verdict(q, id, NF_ACCEPT, 0, NULL);
	held.id[held.next % HELD_MAX] = id;
	held.due[held.next % HELD_MAX] = now_ns() + delay_ns;
	held.next++;
	return 0;
}

// release_all lets go every packet held, in one verdict.
static void release_all(struct nfq_q_handle *q) {
	if (held.first != held.next)
		nfq_set_verdict_batch(q, held.id[(held.next - 1) % HELD_MAX], NF_ACCEPT);
	held.first = held.next;
}

// release lets go every packet due by now, in one verdict.
static void release(struct nfq_q_handle *q, uint64_t now) {
	uint32_t last = held.first;
	if (last == held.next || held.due[last % HELD_MAX] > now)
		return;
	while (last + 1 != held.next && held.due[(last + 1) % HELD_MAX] <= now)
		last++;
	nfq_set_verdict_batch(q, held.id[last % HELD_MAX], NF_ACCEPT);
	held.first = last + 1;
}

static void on_signal(int sig) {
	(void)sig;
	stopping = 1;
}

static int fail(const char *what) {
	perror(what);
	return 1;
}

int main(int argc, char **argv) {
	if (argc < 3 || argc > 4) {
		fprintf(stderr, "usage: %s QUEUE DELAY_US [PIDFILE]\n", argv[0]);
		return 2;
	}
	char *qend, *dend;
	long queue = strtol(argv[1], &qend, 10);
	unsigned long long delay_us = strtoull(argv[2], &dend, 10);
	if (*argv[1] == 0 || *qend || queue < 0 || queue > 65535 || *argv[2] == 0 || *dend || delay_us > 10000000) {
		fprintf(stderr, "%s: QUEUE is 0-65535, DELAY_US at most 10 s\n", argv[0]);
		return 2;
	}
	delay_ns = delay_us * 1000;
	// The signals are blocked but while ppoll waits, which unblocks them: one that comes
	// between the look at stopping and the wait ends the wait instead of being missed.
	struct sigaction sa = {.sa_handler = on_signal};
	sigaction(SIGTERM, &sa, NULL);
	sigaction(SIGINT, &sa, NULL);
	sigset_t stop_signals, waiting;
	sigemptyset(&stop_signals);
	sigaddset(&stop_signals, SIGTERM);
	sigaddset(&stop_signals, SIGINT);
	sigprocmask(SIG_BLOCK, &stop_signals, &waiting);
	prctl(PR_SET_TIMERSLACK, 1UL); // wake when asked: the default slack is 50 us

	struct nfq_handle *h = nfq_open();
	if (!h)
		return fail("nfq_open");
	if (nfq_bind_pf(h, AF_INET) < 0)
		return fail("nfq_bind_pf");
	struct nfq_q_handle *q = nfq_create_queue(h, (uint16_t)queue, on_packet, NULL);
	if (!q)
		return fail("nfq_create_queue");
	// The ids are all a verdict needs: no payload is copied to this process.
	if (nfq_set_mode(q, NFQNL_COPY_META, 0) < 0 && nfq_set_mode(q, NFQNL_COPY_PACKET, 0) < 0)
		return fail("nfq_set_mode");
	nfq_set_queue_maxlen(q, HELD_MAX);
	// Segments stay one packet; a full queue lets packets through rather than drop them.
	nfq_set_queue_flags(q, NFQA_CFG_F_GSO | NFQA_CFG_F_FAIL_OPEN, NFQA_CFG_F_GSO | NFQA_CFG_F_FAIL_OPEN);
	nfnl_rcvbufsiz(nfq_nfnlh(h), 64 << 20);

	if (argc == 4) {
		FILE *f = fopen(argv[3], "w");
		if (!f)
			return fail(argv[3]);
		if (daemon(0, 1) < 0)
			return fail("daemon");
		if (fprintf(f, "%d\n", (int)getpid()) < 0 || fclose(f) != 0)
			return fail(argv[3]); // in the background: the caller waits for the pid in vain
	}

	int fd = nfq_fd(h);
	static char buf[1 << 16];
	while (!stopping) {
		uint64_t now = now_ns();
		release(q, now);
		struct timespec wait, *until = NULL; // no packet held: wait for one
		if (held.first != held.next) {
			uint64_t due = held.due[held.first % HELD_MAX], left = due > now ? due - now : 0;
			wait.tv_sec = (time_t)(left / 1000000000u);
			wait.tv_nsec = (long)(left % 1000000000u);
			until = &wait;
		}
		struct pollfd p = {.fd = fd, .events = POLLIN};
		int ready = ppoll(&p, 1, until, &waiting);
		if (ready < 0 && errno != EINTR)
			return fail("ppoll");
		for (int i = 0; ready > 0 && i < DRAIN_MAX; i++) {
			ssize_t n = recv(fd, buf, sizeof buf, MSG_DONTWAIT);
			if (n < 0 && errno == ENOBUFS) // messages lost: their packets go with a later verdict
				continue;
			if (n <= 0)
				break;
			nfq_handle_packet(h, buf, (int)n);
		}
	}
	release_all(q);
	nfq_destroy_queue(q);
	nfq_close(h);
	return 0;
}
