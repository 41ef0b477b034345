package client

import (
	"bytes"
	"context"
	"encoding/json"
	"math/rand/v2"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/fitcache/fitcache/config"
	"github.com/fitcache/fitcache/core"
	"github.com/fitcache/fitcache/tiers"
)

// stats returns a client's statistics, decoded.
type rangeStats struct {
	Client ClientStats `json:"client"`
	Server struct {
		SourceReads int64 `json:"source_reads"`
		Published   int64 `json:"published"`
		Errors      int64 `json:"errors"`
	} `json:"server"`
}

// randomBytes returns n bytes of a random generator seeded with seed, and the generator.
func randomBytes(n int, seed uint64) ([]byte, *rand.Rand) {
	rng := rand.New(rand.NewPCG(seed, seed+1))
	data := make([]byte, n)
	for i := range data {
		data[i] = byte(rng.Uint32())
	}
	return data, rng
}

func statsOf(t *testing.T, c *Client) rangeStats {
	t.Helper()
	js, err := c.Stats()
	if err != nil {
		t.Fatal(err)
	}
	var s rangeStats
	if err := json.Unmarshal([]byte(js), &s); err != nil {
		t.Fatal(err)
	}
	return s
}

// Ranges of a file larger than the server's tier: the first pass reads the source at once
// and has the server cache the blocks read; the next pass is served from those blocks. Every
// range has the file's bytes (across blocks, at the end, past it), the source is opened once
// by the client and once per block cached by the server, and nothing counts as an error.
func TestRangesOfAFileLargerThanTheTierAreCachedByBlocks(t *testing.T) {
	cfg, _ := startServerWithBudget(t, "12MiB")
	root := t.TempDir()
	data, rng := randomBytes(20<<20+5, 1)
	writeFile(t, root, "big.bin", data)
	c, err := Open(root, cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	type rangeAt struct{ off, n int64 }
	ranges := []rangeAt{{4<<20 - 10, 20}, {int64(len(data)) - 3, 10}, {int64(len(data)) + 1, 10}, {0, 9 << 20}}
	for range 60 {
		ranges = append(ranges, rangeAt{rng.Int64N(int64(len(data))), 1 + rng.Int64N(256<<10)})
	}
	check := func(pass int) {
		for _, r := range ranges {
			p := make([]byte, r.n)
			n, err := c.ReadAt("big.bin", p, r.off)
			want := data[min(r.off, int64(len(data))):min(r.off+r.n, int64(len(data)))]
			if err != nil || !bytes.Equal(p[:n], want) {
				t.Fatalf("pass %d: ReadAt(%d bytes at %d) = %d, %v; want the file's %d bytes", pass, r.n, r.off, n, err, len(want))
			}
		}
	}
	check(1)
	first := statsOf(t, c)
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		if s := statsOf(t, c); s.Server.Published >= 2 && s.Server.Published == s.Server.SourceReads {
			break
		}
	}
	check(2)
	s := statsOf(t, c)
	t.Logf("pass 1: %+v\npass 2: %+v", first, s)
	if first.Client.SourceRanges == 0 || s.Client.SourceRanges-first.Client.SourceRanges >= first.Client.SourceRanges {
		t.Errorf("ranges read from the source: %d in pass 1, %d in pass 2; want fewer once blocks are cached",
			first.Client.SourceRanges, s.Client.SourceRanges-first.Client.SourceRanges)
	}
	if s.Client.SourceOpens != 1 || s.Server.SourceReads > 6 || s.Server.Published < 2 {
		t.Errorf("source opens: %d by the client, %d by the server (%d blocks cached); want 1 and at most one per block (6)",
			s.Client.SourceOpens, s.Server.SourceReads, s.Server.Published)
	}
	if s.Client.Errors != 0 || s.Server.Errors != 0 {
		t.Errorf("errors: client %d, server %d; want none", s.Client.Errors, s.Server.Errors)
	}
}

// While the server is unavailable, a range of a large file is read from the source alone:
// the bytes asked for, through one open of the source, never the whole file.
func TestRangesWhileTheServerIsDownReadTheSourceAlone(t *testing.T) {
	cfg, _ := startServerWithBudget(t, "64MiB")
	root := t.TempDir()
	data, rng := randomBytes(20<<20+5, 2)
	writeFile(t, root, "big.bin", data)
	c, err := Open(root, cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.MarkUnavailable()
	var want int64
	for range 10 {
		off := rng.Int64N(int64(len(data)) - 1000)
		p := make([]byte, 1000)
		if n, err := c.ReadAt("big.bin", p, off); err != nil || n != 1000 || !bytes.Equal(p, data[off:off+1000]) {
			t.Fatalf("ReadAt(1000 bytes at %d) = %d, %v; want the file's bytes", off, n, err)
		}
		want += 1000
	}
	s := statsOf(t, c)
	if s.Client.SourceOpens != 1 || s.Client.SourceRanges != 10 || s.Client.SourceRangeBytes != want ||
		s.Client.DirectReads != 0 {
		t.Errorf("client %+v: want one source open, 10 ranges of %d bytes in all, no whole file read", s.Client, want)
	}
}

// A range that spans two blocks is read as two pieces, the second where the first ended: no
// sign of a reader in sequence, so neither block is asked for (a sparse reader would
// otherwise have a block read from the source for each range that crosses a boundary).
func TestARangeAcrossTwoBlocksIsNoReaderInSequence(t *testing.T) {
	cfg, _ := startServerWithBudget(t, "64MiB")
	root := t.TempDir()
	data, _ := randomBytes(20<<20+5, 3)
	writeFile(t, root, "big.bin", data)
	c, err := Open(root, cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	bb := c.BlockBytes()
	for _, k := range []int64{3, 1, 4} { // out of order: no range starts where another ended
		off := k*bb - 100
		p := make([]byte, 200)
		if n, err := c.ReadAt("big.bin", p, off); err != nil || n != 200 || !bytes.Equal(p, data[off:off+200]) {
			t.Fatalf("ReadAt(200 bytes at %d) = %d, %v", off, n, err)
		}
	}
	time.Sleep(500 * time.Millisecond) // asks, if any, go out in the background
	if s := statsOf(t, c); s.Server.Published != 0 || s.Client.SourceRanges != 6 {
		t.Errorf("%d blocks cached, %d ranges read from the source; want none cached, 6 ranges", s.Server.Published,
			s.Client.SourceRanges)
	}
}

// cacheBlocks has c's server cache the first n blocks (4 MiB) of the file name, read in
// sequence so that each is asked for at once, and waits until they are.
func cacheBlocks(t *testing.T, c *Client, name string, n int64) {
	t.Helper()
	p := make([]byte, 4<<20)
	for i := range n {
		if k, err := c.ReadAt(name, p, i<<22); err != nil || k != len(p) {
			t.Fatalf("block %d: %d, %v", i, k, err)
		}
	}
	for deadline := time.Now().Add(10 * time.Second); statsOf(t, c).Server.Published < n; time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the blocks were not cached")
		}
	}
}

// A new job over blocks an earlier job cached reads them, not the source: a block its tiers
// list unchecked for its session is asked for at once, and the server checks it (one look
// at the file). A copy the server removes is let go by the client's kept mappings.
func TestANewJobReadsTheBlocksAnEarlierOneCached(t *testing.T) {
	cfg, _ := startServerWithBudget(t, "64MiB")
	root := t.TempDir()
	data, _ := randomBytes(12<<20, 3)
	path := writeFile(t, root, "big.bin", data)
	first, err := Open(root, cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer first.Close()
	cacheBlocks(t, first, "big.bin", 3)
	cfg.Job = "another job"
	second, err := Open(root, cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer second.Close()
	q := make([]byte, 1000)
	for _, off := range []int64{10, 5 << 20, 9<<20 + 7} {
		if k, err := second.ReadAt("big.bin", q, off); err != nil || !bytes.Equal(q[:k], data[off:off+1000]) {
			t.Fatalf("ReadAt %d: %d, %v", off, k, err)
		}
	}
	if s := statsOf(t, second); s.Client.SourceRanges != 0 {
		t.Errorf("the new job read %d ranges from the source; want none: the blocks are cached", s.Client.SourceRanges)
	}
	// The server drops the file's copies (a write through the preload shim does): the kept
	// mappings are let go at the next sweep.
	conn, _ := second.current()
	if err := conn.rpc.Forget(context.Background(), root, path); err != nil {
		t.Fatal(err)
	}
	second.ranges.mu.Lock()
	second.ranges.swept = time.Time{}
	second.ranges.mu.Unlock()
	second.ReadAt("big.bin", q, 0)
	second.ranges.mu.Lock()
	kept := 0
	for _, rf := range second.ranges.files {
		if rf.m != nil {
			kept++
		}
	}
	second.ranges.mu.Unlock()
	if kept != 0 {
		t.Errorf("%d mappings of removed copies still kept", kept)
	}
}

// In cluster mode each block of a large file belongs to the server that owns its name on the
// ring: a reader on a node without a server reads the ranges of a block from the source
// until it is cached, then from the block's owner. The file spreads over the servers, and
// each block is read from the source once.
func TestBlocksOfALargeFileSpreadOverTheRing(t *testing.T) {
	root := t.TempDir()
	data, rng := randomBytes(24<<20+3, 5)
	writeFile(t, root, "big.bin", data)
	var servers []*testServer
	var addrs []string
	for _, host := range []string{"127.0.0.2", "127.0.0.3", "127.0.0.4"} {
		s := startClusterServer(t, host, root)
		servers = append(servers, s)
		addrs = append(addrs, s.addr)
	}
	// A call that caches a 4 MiB block reads it from the source first, which under -race on a
	// 2-core machine running other packages' tests can take more than 2 s: the test failed in
	// CI with 6 of 7 blocks cached (twice before, once more on 2026-11-28), put down to such a
	// timeout (see below). The calls get 10 s.
	cfg, err := config.Load(map[string]string{"servers": strings.Join(addrs, ","), "token": "tok", "node": "127.0.0.1",
		"wait_timeout": "5", "rpc_timeout": "10"})
	if err != nil {
		t.Fatal(err)
	}
	c, err := Open(root, cfg, discardLogger())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if c.cluster == nil || c.BlockBytes() != core.DefaultBlockBytes {
		t.Fatalf("not a routing client with blocks (block size %d)", c.BlockBytes())
	}
	p := make([]byte, 1<<20)
	readAll := func() {
		for off := int64(0); off < int64(len(data)); off += int64(len(p)) { // in sequence: each block is asked for at once
			k, err := c.ReadAt("big.bin", p, off)
			if err != nil || !bytes.Equal(p[:k], data[off:min(int64(len(data)), off+int64(len(p)))]) {
				t.Fatalf("ReadAt %d: %d, %v", off, k, err)
			}
		}
	}
	readAll()
	blocks := int64(len(data)+core.DefaultBlockBytes-1) / core.DefaultBlockBytes
	// An ask that failed (a call timed out on a loaded machine: it failed in CI twice, the
	// second time with 6 of 7 blocks cached after three rounds) is made again by the next
	// read of its block after blockAskAgain.
	again := time.Now().Add(blockAskAgain + time.Second)
	for deadline := time.Now().Add(6 * blockAskAgain); sourceReads(servers) < blocks; time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("%d of %d blocks cached", sourceReads(servers), blocks)
		}
		if time.Now().After(again) {
			readAll()
			again = time.Now().Add(blockAskAgain + time.Second)
		}
	}
	marked := func() bool { // the asks' answers mark the blocks cached at the client
		for n := int64(0); n < blocks; n++ {
			if !c.brings.cachedElsewhere(tiers.BlockName(filepath.Join(root, "big.bin"), core.DefaultBlockBytes, n)) {
				return false
			}
		}
		return true
	}
	for deadline := time.Now().Add(10 * time.Second); !marked(); time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the answers to the asks did not mark every block cached")
		}
	}
	before := c.counts.sourceRanges.Load()
	q := make([]byte, 100_000)
	for i := 0; i < 100; i++ {
		off := rng.Int64N(int64(len(data)))
		k, err := c.ReadAt("big.bin", q, off)
		if err != nil || !bytes.Equal(q[:k], data[off:min(int64(len(data)), off+int64(len(q)))]) {
			t.Fatalf("ReadAt %d: %d, %v", off, k, err)
		}
	}
	if n := c.counts.sourceRanges.Load() - before; n != 0 {
		t.Errorf("%d ranges read from the source once every block was cached; want none", n)
	}
	holding := 0
	for _, s := range servers {
		if s.engine.Stats().SourceReads > 0 {
			holding++
		}
	}
	if sourceReads(servers) != blocks || holding < 2 {
		t.Errorf("source reads %d (want %d, one per block), on %d servers (want the blocks spread)",
			sourceReads(servers), blocks, holding)
	}
}
