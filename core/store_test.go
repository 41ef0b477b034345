package core

import (
	"bytes"
	"errors"
	"hash/crc32"
	"io/fs"
	"os"
	"path/filepath"
	"syscall"
	"testing"

	"github.com/fitcache/fitcache/tiers"
)

// TestStoreChecksTheCopy: a replica copy is kept only when its bytes match their checksum and
// the source as this engine sees it has the copy's size, modification time, change time and
// inode number; every refusal is counted, and a later read gets the source's bytes.
func TestStoreChecksTheCopy(t *testing.T) {
	root, paths := dataset(t, 3000)
	path := paths[0]
	data, _ := os.ReadFile(path)
	var st syscall.Stat_t
	if err := syscall.Stat(path, &st); err != nil {
		t.Fatal(err)
	}
	real := StoreRequest{Root: root, Path: path, Data: data, MTimeNanos: st.Mtim.Nano(), CTimeNanos: st.Ctim.Nano(),
		Ino: st.Ino, Checksum: crc32.Checksum(data, crc32.MakeTable(crc32.Castagnoli))}
	forged := bytes.Repeat([]byte{'F'}, len(data))
	forgedSum := crc32.Checksum(forged, crc32.MakeTable(crc32.Castagnoli))
	with := func(f func(r *StoreRequest)) StoreRequest { r := real; f(&r); return r }
	e, err := NewEngine(EngineConfig{Tiers: []tiers.Config{{Dir: t.TempDir(), Kind: tiers.Memory, Budget: "1MiB"}}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	for _, tc := range []struct {
		name string
		req  StoreRequest
		want error
	}{
		{"forged bytes, the real checksum", with(func(r *StoreRequest) { r.Data = forged }), ErrBadCopy},
		{"one byte short, its checksum", with(func(r *StoreRequest) {
			r.Data = data[1:]
			r.Checksum = crc32.Checksum(r.Data, crc32.MakeTable(crc32.Castagnoli))
		}), ErrChanged},
		{"another modification time", with(func(r *StoreRequest) { r.MTimeNanos++ }), ErrChanged},
		{"another change time", with(func(r *StoreRequest) { r.CTimeNanos++ }), ErrChanged},
		{"another inode", with(func(r *StoreRequest) { r.Ino++ }), ErrChanged},
		{"no such source", with(func(r *StoreRequest) { r.Path = filepath.Join(root, "sub", "missing") }), fs.ErrNotExist},
		{"a directory", with(func(r *StoreRequest) { r.Path = filepath.Join(root, "sub") }), syscall.EISDIR},
	} {
		if err := e.Store(tc.req); !errors.Is(err, tc.want) {
			t.Errorf("%s: got %v, want %v", tc.name, err, tc.want)
		}
	}
	if s := e.Stats(); s.StoreRefused != 7 || s.Stored != 0 {
		t.Errorf("after the bad copies: %d refused (want 7), %d stored (want 0)", s.StoreRefused, s.Stored)
	}
	if Errno(e.Store(with(func(r *StoreRequest) { r.Data, r.Checksum = forged, forgedSum+1 }))) != syscall.EBADMSG {
		t.Error("a copy that does not match its checksum is not EBADMSG")
	}
	// Without the owner's change time and inode (a file it served from a tier), size and
	// modification time still have to agree.
	if err := e.Store(with(func(r *StoreRequest) { r.CTimeNanos, r.Ino = 0, 0 })); err != nil {
		t.Fatalf("the real copy: %v", err)
	}
	if _, got := readAll(t, e, root, path); !bytes.Equal(got, data) {
		t.Error("read after the copy: not the source's bytes")
	}
	if s := e.Stats(); s.Stored != 1 || s.SourceReads != 0 {
		t.Errorf("%d stored (want 1), %d source reads (want 0)", s.Stored, s.SourceReads)
	}
}
