package tiers

import (
	"errors"
	"testing"
)

// A copy is served to a reader of a validation session only once the server found it to
// match its source in that session or a later one; a copy whose source changed is removed.
func TestValidateMarksOrRemoves(t *testing.T) {
	tier := newTier(t, Memory, "1MiB")
	src := "/data/a.bin"
	made := Identity{Size: 3, MTimeNanos: 10, CTimeNanos: 11, Ino: 12}
	e := Entry{SourcePath: src, Size: 3, MTimeNanos: 10, SourceCTimeNanos: 11, SourceIno: 12, Session: 5}
	if err := tier.Publish(e, []byte("abc")); err != nil {
		t.Fatal(err)
	}
	reader := readerOf(t, tier)

	// Published in session 5: readers of sessions up to 5 serve it, later ones do not.
	for _, tc := range []struct {
		session uint32
		hit     bool
	}{{0, true}, {5, true}, {6, false}} {
		m, err := reader.WithSession(tc.session).Open(src)
		if got := err == nil; got != tc.hit {
			t.Errorf("session %d: hit %v (err %v), want %v", tc.session, got, err, tc.hit)
		}
		if err == nil {
			m.Release()
		} else if !errors.Is(err, ErrNotCached) {
			t.Errorf("session %d: got %v, want ErrNotCached", tc.session, err)
		}
		if got := Listed([]Dir{reader.WithSession(tc.session)}, src); got != tc.hit {
			t.Errorf("session %d: Listed %v, want %v", tc.session, got, tc.hit)
		}
	}
	if listed, checked := tier.Checked(src, 6); !listed || checked {
		t.Errorf("Checked(6) = %v, %v; want listed, not checked", listed, checked)
	}

	// The source is unchanged: checked in session 6, never moved back to 5.
	if !tier.Validate(src, made, 6) {
		t.Fatal("Validate with the identity the copy was made from removed it")
	}
	tier.Validate(src, made, 5)
	if listed, checked := tier.Checked(src, 6); !listed || !checked {
		t.Errorf("after Validate(6): Checked(6) = %v, %v; want listed and checked", listed, checked)
	}
	if m, err := reader.WithSession(6).Open(src); err != nil {
		t.Errorf("session 6 after validation: %v", err)
	} else {
		m.Release()
	}

	// Each part of the identity tells a changed source.
	for name, cur := range map[string]Identity{
		"size":  {Size: 4, MTimeNanos: 10, CTimeNanos: 11, Ino: 12},
		"mtime": {Size: 3, MTimeNanos: 20, CTimeNanos: 11, Ino: 12},
		"ctime": {Size: 3, MTimeNanos: 10, CTimeNanos: 21, Ino: 12},
		"inode": {Size: 3, MTimeNanos: 10, CTimeNanos: 11, Ino: 22},
	} {
		if err := tier.Publish(e, []byte("abc")); err != nil {
			t.Fatal(err)
		}
		used := tier.Info().Used
		if tier.Validate(src, cur, 7) {
			t.Errorf("%s changed: Validate kept the copy", name)
		}
		if listed, _ := tier.Checked(src, 0); listed {
			t.Errorf("%s changed: the index still lists the copy", name)
		}
		if got := cached(t, tier, src); len(got) != 0 {
			t.Errorf("%s changed: the copy is still served", name)
		}
		if info := tier.Info(); info.Used >= used || info.Files != 0 {
			t.Errorf("%s changed: used %d (was %d), %d files; want the copy's room given back", name, info.Used, used, info.Files)
		}
	}
	if tier.Validate("/data/never-cached", made, 8) {
		t.Error("Validate of a file the tier does not hold returned true")
	}
}

// A copy that recorded no change time or source inode (a replica sent by another server)
// is compared on what it has.
func TestValidateComparesWhatWasRecorded(t *testing.T) {
	tier := newTier(t, Memory, "1MiB")
	publish(t, tier, "/data/r.bin", []byte("xyz")) // size 3, mtime 1, no ctime or inode
	if !tier.Validate("/data/r.bin", Identity{Size: 3, MTimeNanos: 1, CTimeNanos: 99, Ino: 98}, 1) {
		t.Error("a copy without ctime and inode was removed though size and mtime match")
	}
	if tier.Validate("/data/r.bin", Identity{Size: 3, MTimeNanos: 2, CTimeNanos: 99, Ino: 98}, 2) {
		t.Error("a copy whose source mtime changed was kept")
	}
}

// A rescan (a server restart) keeps the copies and their source identities, and marks every
// copy unchecked: the restarted server checks each against its source before serving it to
// a session.
func TestRescanKeepsIdentityAndForgetsChecks(t *testing.T) {
	dir := t.TempDir()
	tier, err := New(Config{Dir: dir, Kind: Memory, Budget: "1MiB"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	id := Identity{Size: 3, MTimeNanos: 10, CTimeNanos: 11, Ino: 12}
	if err := tier.Publish(Entry{SourcePath: "/d/f", Size: 3, MTimeNanos: 10, SourceCTimeNanos: 11, SourceIno: 12,
		Session: 9}, []byte("abc")); err != nil {
		t.Fatal(err)
	}
	tier.Close()
	tier, err = New(Config{Dir: dir, Kind: Memory, Budget: "1MiB"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer tier.Close()
	if listed, checked := tier.Checked("/d/f", 1); !listed || checked {
		t.Errorf("after rescan: Checked(1) = %v, %v; want listed, not checked", listed, checked)
	}
	if tier.Validate("/d/f", Identity{Size: 3, MTimeNanos: 10, CTimeNanos: 11, Ino: 13}, 1) {
		t.Error("after rescan the recorded source inode was lost: a replaced source kept its copy")
	}
	if err := tier.Publish(Entry{SourcePath: "/d/f", Size: 3, MTimeNanos: 10, SourceCTimeNanos: 11, SourceIno: 12},
		[]byte("abc")); err != nil {
		t.Fatal(err)
	}
	if !tier.Validate("/d/f", id, 2) {
		t.Error("the identity recorded at publication does not match itself")
	}
}

// The blocks of a file are checked at once against the file's identity: each block that
// copies that version (its own length, the file's times and inode) is marked, and once the
// file changed they are all removed, the whole file's copy left to its own check.
func TestValidateBlocksChecksAFilesBlocksAtOnce(t *testing.T) {
	tier := newTier(t, Memory, "1MiB")
	file := Identity{Size: 10, MTimeNanos: 10, CTimeNanos: 11, Ino: 12}
	for n, data := range []string{"abcd", "efgh", "ij"} { // blocks of 4 bytes
		e := Entry{SourcePath: BlockName("/data/f", 4, int64(n)), Size: int64(len(data)), MTimeNanos: 10,
			SourceCTimeNanos: 11, SourceIno: 12, Session: 1, Group: "/data"}
		if err := tier.Publish(e, []byte(data)); err != nil {
			t.Fatal(err)
		}
	}
	whole := Entry{SourcePath: "/data/f", Size: 10, MTimeNanos: 10, SourceCTimeNanos: 11, SourceIno: 12, Session: 1,
		Group: "/data"}
	if err := tier.Publish(whole, []byte("abcdefghij")); err != nil {
		t.Fatal(err)
	}
	if tier.ValidateBlocks("/data/f", file, 2) {
		t.Fatal("blocks of the version the file is removed")
	}
	for n := range int64(3) {
		if listed, checked := tier.Checked(BlockName("/data/f", 4, n), 2); !listed || !checked {
			t.Errorf("block %d: listed %v, checked %v; want both", n, listed, checked)
		}
	}
	if _, checked := tier.Checked("/data/f", 2); checked {
		t.Error("the whole file's copy was marked with its blocks")
	}
	changed := file
	changed.MTimeNanos++
	if !tier.ValidateBlocks("/data/f", changed, 3) {
		t.Fatal("blocks of a changed file kept")
	}
	for n := range int64(3) {
		if tier.Listed(BlockName("/data/f", 4, n)) {
			t.Errorf("block %d of the changed file kept", n)
		}
	}
	if !tier.Listed("/data/f") {
		t.Error("the whole file's copy removed with its blocks")
	}
}
