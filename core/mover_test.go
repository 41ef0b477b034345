package core

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"testing"

	"github.com/fitcache/fitcache/tiers"
)

// An entry overwritten in place is not spilled to a slower tier when evicted: the slower
// tier would record a fresh checksum of the damaged bytes, and verification could no longer
// find them. In a build without it, it was spilled.
func TestDamagedEntryIsNotSpilled(t *testing.T) {
	// Three datasets: a full tier never evicts a file of the dataset being read to make room
	// for another of its files (see tiers.Tier.MakeRoom).
	root, paths := dataset(t, 5000)
	rootB, pathsB := dataset(t, 5000)
	rootC, pathsC := dataset(t, 5000)
	one := tiers.EntrySize(paths[0], 5000)
	memDir, diskDir := t.TempDir(), t.TempDir()
	e, err := NewEngine(EngineConfig{Tiers: []tiers.Config{
		{Dir: memDir, Kind: tiers.Memory, Budget: fmt.Sprint(one)},
		{Dir: diskDir, Kind: tiers.Disk, Budget: fmt.Sprint(one)}}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	readAll(t, e, root, paths[0])
	settle(e)
	f, err := os.OpenFile((tiers.Dir{Path: memDir}).CachedPath(paths[0]), os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	f.WriteAt([]byte("EVIL"), 100)
	f.Close()
	readAll(t, e, rootB, pathsB[0]) // fills the disk tier
	settle(e)
	readAll(t, e, rootC, pathsC[0]) // evicts paths[0] from memory, which would spill to disk
	settle(e)
	if _, err := os.Stat((tiers.Dir{Path: diskDir}).CachedPath(paths[0])); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("the damaged entry was spilled to disk (stat: %v)", err)
	}
	if s := e.Stats(); s.Spilled != 0 {
		t.Errorf("spilled %d, want 0", s.Spilled)
	}
}
