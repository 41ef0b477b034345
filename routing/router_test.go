package routing

import (
	"fmt"
	"log/slog"
	"syscall"
	"testing"

	"github.com/fitcache/fitcache/config"
	"github.com/fitcache/fitcache/ring"
)

// Table tests of cluster routing without servers: a router over peers that are never called,
// whose deaths the tests set, to check placement under each policy and the failure threshold.

// testRouter returns a router over servers given as id -> node, all alive.
func testRouter(t *testing.T, policy string, replicas int, servers map[string]string) *Router {
	t.Helper()
	r := &Router{cfg: config.Config{Policy: policy, Replicas: replicas, FailureThreshold: 3},
		log: slog.New(slog.DiscardHandler), ring: ring.New(100, nil), peers: map[string]*Peer{}}
	for id, node := range servers {
		m := ring.Member{ID: id, Node: node}
		r.ring.Add(m)
		r.peers[id] = &Peer{member: m}
	}
	return r
}

func ids(ps []*Peer) []string {
	var out []string
	for _, p := range ps {
		out = append(out, p.member.ID)
	}
	return out
}

var fourNodes = map[string]string{"a:1": "a", "b:1": "b", "c:1": "c", "d:1": "d"}

// keys are the file paths the placement tests route.
func keys() []string {
	var out []string
	for i := 0; i < 2000; i++ {
		out = append(out, fmt.Sprintf("/data/train/class%03d/img%05d.jpg", i%100, i))
	}
	return out
}

func TestPlacementWhenAServerDies(t *testing.T) {
	for _, tc := range []struct {
		policy string
		// want, for a file the dead server owned: where it goes now ("next": the next live
		// server clockwise, as if the dead one were removed from the ring; "": the source).
		want string
	}{
		{config.PolicyRecache, "next"},
		{config.PolicyPFS, ""},
	} {
		t.Run(tc.policy, func(t *testing.T) {
			r := testRouter(t, tc.policy, 1, fourNodes)
			before := map[string]string{}
			for _, k := range keys() {
				before[k] = ids(r.Targets(k))[0]
			}
			r.peers["b:1"].dead = true
			without := ring.New(100, nil) // the ring as if b were removed
			for id, node := range fourNodes {
				if id != "b:1" {
					without.Add(ring.Member{ID: id, Node: node})
				}
			}
			moved := 0
			for _, k := range keys() {
				got := ids(r.Targets(k))
				switch {
				case before[k] != "b:1":
					if len(got) != 1 || got[0] != before[k] {
						t.Fatalf("%s owned by live %s went to %v", k, before[k], got)
					}
				case tc.want == "next":
					moved++
					next, _ := without.Lookup(k)
					if len(got) != 1 || got[0] != next.ID {
						t.Fatalf("%s of the dead server went to %v, want %s", k, got, next.ID)
					}
				default:
					moved++
					if len(got) != 0 {
						t.Fatalf("%s of the dead server went to %v, want the source under pfs", k, got)
					}
				}
			}
			if moved == 0 {
				t.Fatal("the dead server owned no file: the test routes too few keys")
			}
			// Rejoin: placement is what it was.
			r.peers["b:1"].dead = false
			for _, k := range keys() {
				if got := ids(r.Targets(k)); len(got) != 1 || got[0] != before[k] {
					t.Fatalf("after rejoin %s went to %v, want %s", k, got, before[k])
				}
			}
		})
	}
}

func TestReplicasGoToDistinctNodes(t *testing.T) {
	servers := map[string]string{"a:1": "a", "a:2": "a", "b:1": "b", "c:1": "c"}
	r := testRouter(t, config.PolicyRecache, 2, servers)
	for _, k := range keys() {
		got := ids(r.Targets(k))
		if len(got) != 2 || servers[got[0]] == servers[got[1]] {
			t.Fatalf("%s: targets %v, want 2 servers on distinct nodes", k, got)
		}
	}
	// With two of three nodes dead, under recache every file goes to the one left.
	r.peers["a:1"].dead, r.peers["a:2"].dead, r.peers["b:1"].dead = true, true, true
	for _, k := range keys() {
		if got := ids(r.Targets(k)); len(got) != 1 || got[0] != "c:1" {
			t.Fatalf("%s: targets %v, want only c:1", k, got)
		}
	}
}

// With replicas, a dead server's files are read from the live copy. Under pfs no server that
// held no copy is added in its place (it would cache them: that is recache); under recache
// the next live node takes the dead one's slot.
func TestReplicasWhenAServerDies(t *testing.T) {
	for _, tc := range []struct {
		policy  string
		wantLen int
	}{
		{config.PolicyPFS, 1},
		{config.PolicyRecache, 2},
	} {
		t.Run(tc.policy, func(t *testing.T) {
			r := testRouter(t, tc.policy, 2, fourNodes)
			before := map[string][]string{}
			for _, k := range keys() {
				before[k] = ids(r.Targets(k))
			}
			r.peers["b:1"].dead = true
			moved := 0
			for _, k := range keys() {
				got := ids(r.Targets(k))
				if before[k][0] != "b:1" {
					continue
				}
				moved++
				if len(got) != tc.wantLen || got[0] != before[k][1] {
					t.Fatalf("%s: copies were on %v, after b:1 died targets %v; want %d starting with the replica %s",
						k, before[k], got, tc.wantLen, before[k][1])
				}
			}
			if moved == 0 {
				t.Fatal("the dead server owned no file: the test routes too few keys")
			}
		})
	}
}

// timeoutErr is a call that timed out (the server may be slow, not dead).
type timeoutErr struct{}

func (timeoutErr) Error() string { return "timed out" }
func (timeoutErr) Timeout() bool { return true }

func TestFailureThreshold(t *testing.T) {
	r := testRouter(t, config.PolicyRecache, 1, fourNodes)
	p := r.peers["a:1"]
	for i := 1; i < r.cfg.FailureThreshold; i++ {
		if r.Failed(p, timeoutErr{}) {
			t.Fatalf("dead after %d timeouts, threshold %d", i, r.cfg.FailureThreshold)
		}
	}
	r.Succeeded(p) // an answer resets the count
	for i := 1; i < r.cfg.FailureThreshold; i++ {
		if r.Failed(p, timeoutErr{}) {
			t.Fatalf("dead after %d timeouts following a success", i)
		}
	}
	if !r.Failed(p, timeoutErr{}) {
		t.Fatalf("alive after %d timeouts in a row", r.cfg.FailureThreshold)
	}
	// The others hear of it.
	if _, dead, _ := r.peers["b:1"].news.Take(); len(dead) != 1 || dead[0] != "a:1" {
		t.Errorf("b:1 is to be told dead %v, want [a:1]", dead)
	}
	// A refused connection is death at once.
	if !r.Failed(r.peers["c:1"], fmt.Errorf("dial: %w", syscall.ECONNREFUSED)) {
		t.Error("a refused connection did not declare the server dead")
	}
	if got := r.deaths.Load(); got != 2 {
		t.Errorf("deaths %d, want 2", got)
	}
}

func TestDeathsLearnedFromAServer(t *testing.T) {
	r := testRouter(t, config.PolicyRecache, 1, fourNodes)
	r.learn(r.peers["a:1"], 1, []string{"c:1"})
	if _, dead := r.peers["c:1"].State(); !dead {
		t.Error("c:1 alive after a:1 said its clients found it dead")
	}
	r.peers["c:1"].dead = false
	r.learn(r.peers["a:1"], 1, []string{"c:1"}) // the same version again: old news
	if _, dead := r.peers["c:1"].State(); dead {
		t.Error("old news declared c:1 dead again")
	}
}

// BenchmarkTargets is the placement of one read in a 64-server job with two replicas: a few
// steps of the ring walk, on every read a client routes.
func BenchmarkTargets(b *testing.B) {
	servers := map[string]string{}
	for i := 0; i < 64; i++ {
		servers[fmt.Sprintf("n%02d:1", i/2)+fmt.Sprint(i%2)] = fmt.Sprintf("n%02d", i/2)
	}
	r := &Router{cfg: config.Config{Policy: config.PolicyRecache, Replicas: 2},
		ring: ring.New(100, nil), peers: map[string]*Peer{}}
	for id, node := range servers {
		m := ring.Member{ID: id, Node: node}
		r.ring.Add(m)
		r.peers[id] = &Peer{member: m}
	}
	ks := keys()
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if len(r.Targets(ks[i%len(ks)])) != 2 {
			b.Fatal("want 2 targets")
		}
	}
}
