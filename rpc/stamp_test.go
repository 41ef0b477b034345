package rpc

import (
	"bytes"
	"context"
	"errors"
	"hash/crc32"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/fitcache/fitcache/core"
)

// storeSetup serves an owner and a replica with the job token, and a file of the dataset.
func storeSetup(t *testing.T) (owner, replica *Client, replicaEngine *core.Engine, root, path string, data []byte) {
	t.Helper()
	ownerAddr, _, _ := serveTCP(t, ServerConfig{Token: testToken})
	replicaAddr, _, replicaEngine := serveTCP(t, ServerConfig{Token: testToken})
	owner, _ = Dial(ownerAddr, ClientConfig{Token: testToken})
	replica, _ = Dial(replicaAddr, ClientConfig{Token: testToken})
	t.Cleanup(func() { owner.Close(); replica.Close() })
	root = t.TempDir()
	path = filepath.Join(root, "train.bin")
	data = bytes.Repeat([]byte("the real bytes "), 1000)
	if err := os.WriteFile(path, data, 0o644); err != nil {
		t.Fatal(err)
	}
	return owner, replica, replicaEngine, root, path, data
}

// TestStoreTakesOnlyCopiesItsOwnerStamped: a replica keeps a copy only if its bytes match
// the checksum and stamp its owner put in its Read reply and the source it sees itself;
// forged bytes are refused with EBADMSG and counted, and the replica serves the real bytes.
func TestStoreTakesOnlyCopiesItsOwnerStamped(t *testing.T) {
	owner, replica, e, root, path, data := storeSetup(t)
	ctx := context.Background()
	r, err := owner.Read(ctx, root, path, false)
	if err != nil || !bytes.Equal(r.Data, data) {
		t.Fatalf("owner read: %v", err)
	}
	stamp := StampOf(r)
	forged := bytes.Repeat([]byte("forged bytes!! "), 1000)
	withSum := stamp
	withSum.Checksum = crc32.Checksum(forged, castagnoli)
	otherKey := NewStamper("a token of no job").Stamp(path, core.Result{Data: forged, MTimeNanos: stamp.MTimeNanos,
		CTimeNanos: stamp.CTimeNanos, Ino: stamp.Ino})
	for _, tc := range []struct {
		name  string
		data  []byte
		stamp Stamp
	}{
		{"forged bytes, the owner's stamp", forged, stamp},
		{"forged bytes, their own checksum", forged, withSum},
		{"forged bytes, stamped with another key", forged, otherKey},
		{"no stamp", data, Stamp{MTimeNanos: stamp.MTimeNanos, Checksum: stamp.Checksum}},
		{"the real bytes, cut short", data[:len(data)-1], stamp},
	} {
		err := replica.Store(ctx, root, path, tc.data, tc.stamp)
		if core.Errno(err) != syscall.EBADMSG || !errors.Is(err, core.ErrBadCopy) {
			t.Errorf("%s: got %v, want EBADMSG (ErrBadCopy)", tc.name, err)
		}
	}
	if s := e.Stats(); s.StoreRefused != 5 || s.Stored != 0 {
		t.Errorf("after forged copies: %d refused (want 5), %d stored (want 0)", s.StoreRefused, s.Stored)
	}
	if err := replica.Store(ctx, root, path, data, stamp); err != nil {
		t.Fatalf("the owner's copy: %v", err)
	}
	got, err := replica.Read(ctx, root, path, false)
	if err != nil || !bytes.Equal(got.Data, data) || OriginOf(got) == core.OriginSource {
		t.Errorf("replica read after the owner's copy: origin %q, real bytes %v, %v", got.GetOrigin(), bytes.Equal(got.GetData(), data), err)
	}
	if s := e.Stats(); s.Stored != 1 || s.SourceReads != 0 {
		t.Errorf("%d stored (want 1), %d source reads (want 0)", s.Stored, s.SourceReads)
	}
}

// TestStoreRefusesAStaleCopy: a copy of a version of the source that is no longer there is
// refused (EAGAIN), even with its owner's stamp.
func TestStoreRefusesAStaleCopy(t *testing.T) {
	owner, replica, e, root, path, data := storeSetup(t)
	ctx := context.Background()
	r, err := owner.Read(ctx, root, path, false)
	if err != nil {
		t.Fatal(err)
	}
	later := time.Now().Add(time.Hour)
	os.Chtimes(path, later, later)
	if err := replica.Store(ctx, root, path, data, StampOf(r)); !errors.Is(err, core.ErrChanged) || core.Errno(err) != syscall.EAGAIN {
		t.Errorf("stale copy: got %v, want EAGAIN (ErrChanged)", err)
	}
	if s := e.Stats(); s.StoreRefused != 1 || s.Stored != 0 {
		t.Errorf("%d refused (want 1), %d stored (want 0)", s.StoreRefused, s.Stored)
	}
}
