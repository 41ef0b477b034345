package core

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"github.com/fitcache/fitcache/tiers"
)

// identityFor returns what an owner's reply says of the source file at path.
func identityFor(t *testing.T, e *Engine, root, path string) tiers.Identity {
	t.Helper()
	id, err := e.sourceIdentity(root, path, e.Session())
	if err != nil {
		t.Fatal(err)
	}
	return id
}

// A guest copy is kept while there is room the server's own files do not need, is served
// like any copy, and gives way to the server's own files; a guest that does not fit without
// pushing out one of them is not kept (ErrCacheFull).
func TestStoreGuestKeepsNodeLocalCopiesInSpareRoom(t *testing.T) {
	e := newEngine(t, "64KiB") // 8 entries of 4 KiB data + a record block
	root := t.TempDir()
	write := func(name string) string {
		p := filepath.Join(root, name)
		if err := os.WriteFile(p, make([]byte, 4096), 0o644); err != nil {
			t.Fatal(err)
		}
		return p
	}
	guest := func(p string) error {
		data, _ := os.ReadFile(p)
		return e.StoreGuest(context.Background(), GuestCopy{Root: root, Path: p, Data: data,
			Source: identityFor(t, e, root, p), Session: e.Session()})
	}
	var guests []string
	for i := range 4 {
		p := write(fmt.Sprintf("guest%d", i))
		if err := guest(p); err != nil {
			t.Fatalf("guest %d: %v", i, err)
		}
		guests = append(guests, p)
	}
	if origin, got := readAll(t, e, root, guests[0]); origin != OriginMemory || len(got) != 4096 {
		t.Errorf("a guest is served from %q with %d bytes, want the memory tier", origin, len(got))
	}
	if s := e.Stats(); s.Guests != 4 || s.SourceReads != 0 {
		t.Errorf("%d guests kept, %d source reads; want 4 and none", s.Guests, s.SourceReads)
	}
	// The server's own files push the guests out, oldest first.
	for i := range 6 {
		readAll(t, e, root, write(fmt.Sprintf("own%d", i)))
	}
	kept := 0
	for _, p := range guests {
		if _, ok := e.cachedSize(p); ok {
			kept++
		}
	}
	if kept != 2 {
		t.Errorf("%d guests kept after 6 own files in room for 8, want 2", kept)
	}
	// Room full of own files and guests: a guest of another dataset takes a guest's place, one
	// of the same dataset does not (its guests would replace each other every epoch), and
	// none takes an own file's.
	if err := guest(write("guest-same-dataset")); !errors.Is(err, ErrCacheFull) {
		t.Errorf("a guest of the dataset in place of another of it: %v, want ErrCacheFull", err)
	}
	other := t.TempDir()
	otherFile := filepath.Join(other, "guest-other")
	os.WriteFile(otherFile, make([]byte, 4096), 0o644)
	data, _ := os.ReadFile(otherFile)
	if err := e.StoreGuest(context.Background(), GuestCopy{Root: other, Path: otherFile, Data: data,
		Source: identityFor(t, e, other, otherFile), Session: e.Session()}); err != nil {
		t.Errorf("a guest of another dataset in place of one: %v", err)
	}
	for i := range 6 {
		if _, ok := e.cachedSize(filepath.Join(root, fmt.Sprintf("own%d", i))); !ok {
			t.Errorf("own%d was pushed out by a guest", i)
		}
	}
	for i := 6; i < 8; i++ {
		readAll(t, e, root, write(fmt.Sprintf("own%d", i)))
	}
	if err := guest(write("guest-late")); !errors.Is(err, ErrCacheFull) {
		t.Errorf("a guest with the tier full of own files: %v, want ErrCacheFull", err)
	}
}

// A guest whose bytes do not match the size its owner gave is refused.
func TestStoreGuestRefusesAShortCopy(t *testing.T) {
	e := newEngine(t, "1MiB")
	root, paths := dataset(t, 100)
	id := identityFor(t, e, root, paths[0])
	err := e.StoreGuest(context.Background(), GuestCopy{Root: root, Path: paths[0], Data: make([]byte, 99), Source: id})
	if !errors.Is(err, ErrBadCopy) {
		t.Errorf("a short guest: %v, want ErrBadCopy", err)
	}
}

// A prefetch evicts no file of the server's own, but node-local copies never hold one back:
// a tier full of guests makes room for the files a prefetch brings, which stay cached. Before,
// those files found no room, were served uncached, and were read from the source again at
// every epoch.
func TestPrefetchOfOwnFilesPushesGuestsOut(t *testing.T) {
	e := prefetchEngine(t, 4, nil, "64KiB") // 8 entries of 4 KiB data + a record block
	root := t.TempDir()
	other := t.TempDir() // the guests' dataset
	for i := range 8 {
		p := filepath.Join(other, fmt.Sprintf("guest%d", i))
		os.WriteFile(p, make([]byte, 4096), 0o644)
		data, _ := os.ReadFile(p)
		if err := e.StoreGuest(context.Background(), GuestCopy{Root: other, Path: p, Data: data,
			Source: identityFor(t, e, other, p), Session: e.Session()}); err != nil {
			t.Fatalf("guest %d: %v", i, err)
		}
	}
	var own []string
	for i := range 4 {
		p := filepath.Join(root, fmt.Sprintf("own%d", i))
		os.WriteFile(p, make([]byte, 4096), 0o644)
		own = append(own, p)
	}
	if _, err := e.Prefetch(PrefetchRequest{Root: root, Owner: "a", Paths: own}); err != nil {
		t.Fatal(err)
	}
	if final := waitPrefetch(t, e, root, "a"); final.Done != len(own) || final.Failed != 0 {
		t.Errorf("prefetch: %+v, want all %d files done", final, len(own))
	}
	settle(e)
	for _, p := range own {
		if _, ok := e.cachedSize(p); !ok {
			t.Errorf("%s not cached: the guests held it back", filepath.Base(p))
		}
	}
	if s := e.Stats(); s.Guests != 8 || s.Uncached != 0 {
		t.Errorf("%d guests kept in all, %d files uncached; want the 8 kept before, none uncached", s.Guests, s.Uncached)
	}
}
