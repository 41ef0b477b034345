package tiers

import (
	"errors"
	"os"
	"path/filepath"
	"testing"
)

// A server's record of its tiers leads a reader to them, and only when nothing in the way
// could have been put there by someone else: the runtime directory private, the record a
// regular file of this user that no one else may write, reached through no link.
func TestServedTiersAreFoundOnlyThroughPrivatePlaces(t *testing.T) {
	tier := newTier(t, Memory, "1MiB")
	run := filepath.Join(t.TempDir(), "run")
	if err := os.Mkdir(run, 0o700); err != nil {
		t.Fatal(err)
	}
	name := ServedName("127.0.0.1:7070")
	if err := WriteServed(run, name, []Dir{tier.Dir}); err != nil {
		t.Fatal(err)
	}
	dirs, err := OpenServed(run, name)
	if err != nil {
		t.Fatal(err)
	}
	if len(dirs) != 1 || dirs[0].Path != tier.Path || dirs[0].Kind != Memory {
		t.Errorf("OpenServed gave %v, want the memory tier %s", dirs, tier.Path)
	}
	for _, d := range dirs {
		d.Close()
	}

	record := filepath.Join(run, name)
	for _, tc := range []struct {
		name  string
		spoil func(t *testing.T) (undo func())
	}{
		{"record writable by the group", func(t *testing.T) func() {
			os.Chmod(record, 0o620)
			return func() { os.Chmod(record, 0o600) }
		}},
		{"record is a link", func(t *testing.T) func() {
			real := record + ".real"
			os.Rename(record, real)
			if err := os.Symlink(real, record); err != nil {
				t.Fatal(err)
			}
			return func() { os.Remove(record); os.Rename(real, record) }
		}},
		{"runtime directory open to others", func(t *testing.T) func() {
			os.Chmod(run, 0o755)
			return func() { os.Chmod(run, 0o700) }
		}},
		{"runtime directory is a link", func(t *testing.T) func() {
			real := run + ".real"
			os.Rename(run, real)
			if err := os.Symlink(real, run); err != nil {
				t.Fatal(err)
			}
			return func() { os.Remove(run); os.Rename(real, run) }
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			undo := tc.spoil(t)
			defer undo()
			if dirs, err := OpenServed(run, name); err == nil {
				for _, d := range dirs {
					d.Close()
				}
				t.Errorf("OpenServed opened %d tiers, want an error", len(dirs))
			}
		})
	}
	if _, err := OpenServed(run, ServedName("127.0.0.1:7071")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("no record: %v, want an error wrapping os.ErrNotExist", err)
	}
}

// OpenVersion serves a copy whatever session it was checked in, but only for the version of
// the source that the copy's index slot names: size, modification and change times, inode.
func TestOpenVersionServesOnlyTheCopysVersion(t *testing.T) {
	tier := newTier(t, Memory, "1MiB")
	src := "/data/a.bin"
	data := []byte("version one")
	v := Identity{Size: int64(len(data)), MTimeNanos: 100, CTimeNanos: 200, Ino: 300}
	e := Entry{SourcePath: src, Size: v.Size, MTimeNanos: v.MTimeNanos, SourceCTimeNanos: v.CTimeNanos, SourceIno: v.Ino,
		Session: 1}
	if err := tier.Publish(e, data); err != nil {
		t.Fatal(err)
	}
	d := readerOf(t, tier)
	d = d.WithSession(1 << 30) // a session no copy was checked in
	if m, err := d.Open(src); err == nil {
		m.Release()
		t.Fatal("Open served a copy not checked in the reader's session")
	}
	m, err := d.OpenVersion(src, v)
	if err != nil {
		t.Fatalf("OpenVersion of the copy's version: %v", err)
	}
	if string(m.Bytes()) != string(data) {
		t.Errorf("OpenVersion mapped %q, want %q", m.Bytes(), data)
	}
	m.Release()
	for name, other := range map[string]Identity{
		"size":  {Size: v.Size + 1, MTimeNanos: v.MTimeNanos, CTimeNanos: v.CTimeNanos, Ino: v.Ino},
		"mtime": {Size: v.Size, MTimeNanos: v.MTimeNanos + 1, CTimeNanos: v.CTimeNanos, Ino: v.Ino},
		"ctime": {Size: v.Size, MTimeNanos: v.MTimeNanos, CTimeNanos: v.CTimeNanos + 1, Ino: v.Ino},
		"inode": {Size: v.Size, MTimeNanos: v.MTimeNanos, CTimeNanos: v.CTimeNanos, Ino: v.Ino + 1},
	} {
		if m, err := d.OpenVersion(src, other); !errors.Is(err, ErrNotCached) {
			if m != nil {
				m.Release()
			}
			t.Errorf("another %s: %v, want ErrNotCached", name, err)
		}
	}
}
