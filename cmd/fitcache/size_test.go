package main

import (
	"fmt"
	"path/filepath"
	"strings"
	"testing"

	"github.com/fitcache/fitcache/ring"
	"github.com/fitcache/fitcache/tiers"
)

// The tiers line of `fitcache size` names the busiest server's share of the dataset: for the
// job's servers, exactly as their ring places the files (keyed by their absolute paths); for
// a number of servers, over typical jobs of that many; for one, the whole dataset.
func TestSizeNamesTheBusiestServersShare(t *testing.T) {
	t.Setenv("FITCACHE_SERVERS", "")
	root := t.TempDir()
	var files []sizedFile
	for i := range 3000 {
		files = append(files, sizedFile{filepath.Join(root, fmt.Sprintf("c%02d", i%30), fmt.Sprintf("f%05d", i)), int64(1000 + i%977)})
	}
	servers := []string{"gpu001:7070", "gpu002:7070", "gpu003:7070"}
	out, err := tierShares(files, strings.Join(servers, ","), 1)
	if err != nil {
		t.Fatal(err)
	}
	r := ring.New(ring.VirtualNodesFor(len(servers)), nil)
	for _, s := range servers {
		r.Add(ring.Member{ID: s, Node: strings.Split(s, ":")[0]})
	}
	owned := map[string]int64{}
	for _, f := range files {
		m, _ := r.Lookup(f.path)
		owned[m.ID] += f.size
	}
	var most int64
	for _, b := range owned {
		most = max(most, b)
	}
	if want := "3 servers, 1000 virtual nodes each: the busiest owns " + tiers.FormatBytes(most); !strings.Contains(out, want) {
		t.Errorf("with the job's servers: %q, want it to say %q", out, want)
	}

	out, err = tierShares(files, "16", 1)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(out, "16 servers (name them with --servers") || !strings.Contains(out, "in 9 of 10") {
		t.Errorf("with a number of servers: %q", out)
	}
	out, err = tierShares(files, "", 1)
	if err != nil || !strings.Contains(out, "one server owns the whole dataset") {
		t.Errorf("one server: %q, %v", out, err)
	}
	if _, err := tierShares(files, "@/no/such/hostfile", 1); err == nil {
		t.Error("a missing hostfile: no error")
	}
}
