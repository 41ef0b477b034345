package rpc

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/binary"
	"hash/crc32"

	"github.com/fitcache/fitcache/core"
	"github.com/fitcache/fitcache/rpc/kitex_gen/fitcachepb"
)

// A stamp is what the owner of a file puts on the file it serves, so that a replica it is
// passed on to (see Client.Store) can tell the owner's bytes from others: an HMAC-SHA256,
// with the job's stamp key, over
//
//	"fitcache replica stamp v1" | NUL | path length (4 bytes) | path | size (8) | mtime (8) |
//	ctime (8) | inode (8) | CRC-32C of the data (4)
//
// (integers big endian; mtime and ctime in Unix nanoseconds; ctime and inode as the owner's
// source read saw them, or as its tier recorded them for a cached copy, 0 where unknown). The replica recomputes the CRC-32C of the bytes it is sent
// and the stamp, and compares size and times with its own stat of the source (see
// core.Engine.Store). Any holder of the token can stamp: a stamp keeps out bytes that are not
// the owner's (damaged or forged on their way by a client), not a server of the job.
const stampLabel = "fitcache replica stamp v1"

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// stamp returns the stamp of a file as c describes it (its Data only for its length, which
// size gives when the data did not travel).
func (k *jobKeys) stamp(path string, size int64, c core.StoreRequest) []byte {
	m := hmac.New(sha256.New, k.stamping)
	b := make([]byte, 0, len(stampLabel)+1+4+len(path)+8*4+4)
	b = append(append(b, stampLabel...), 0)
	b = binary.BigEndian.AppendUint32(b, uint32(len(path)))
	b = append(b, path...)
	b = binary.BigEndian.AppendUint64(b, uint64(size))
	b = binary.BigEndian.AppendUint64(b, uint64(c.MTimeNanos))
	b = binary.BigEndian.AppendUint64(b, uint64(c.CTimeNanos))
	b = binary.BigEndian.AppendUint64(b, c.Ino)
	b = binary.BigEndian.AppendUint32(b, c.Checksum)
	m.Write(b)
	return m.Sum(nil)
}

// validStamp reports whether mac is the stamp of the copy c of the file at path.
func (k *jobKeys) validStamp(path string, c core.StoreRequest, mac []byte) bool {
	return hmac.Equal(mac, k.stamp(path, int64(len(c.Data)), c))
}

// resultStamp returns the stamp of a file an engine served.
func (k *jobKeys) resultStamp(path string, res core.Result) Stamp {
	c := core.StoreRequest{MTimeNanos: res.MTimeNanos, CTimeNanos: res.CTimeNanos, Ino: res.Ino}
	if res.Mapping != nil {
		c.Checksum = res.Mapping.Checksum // as the tier recorded it when it published the file
	} else {
		c.Checksum = crc32.Checksum(res.Data, castagnoli)
	}
	return Stamp{MTimeNanos: c.MTimeNanos, CTimeNanos: c.CTimeNanos, Ino: c.Ino, Checksum: c.Checksum,
		MAC: k.stamp(path, res.Size(), c)}
}

// stampReply sets the checksum, the source's identity and the stamp of a successful read's
// reply (see the IDL's ReadReply).
func (h *Handler) stampReply(path string, res core.Result, reply *fitcachepb.ReadReply) {
	s := h.keys.resultStamp(path, res)
	reply.Checksum, reply.CtimeNanos, reply.Inode, reply.Stamp = int64(s.Checksum), s.CTimeNanos, int64(s.Ino), s.MAC
}

// Stamper stamps the files an engine of a job's server serves to that server's own cluster
// client, which passes them on to replicas without a Read over the wire (see StampOf for
// the others). It is safe for concurrent use.
type Stamper struct{ keys *jobKeys }

// NewStamper returns a stamper with the job's stamp key.
func NewStamper(token string) Stamper { return Stamper{keys: newJobKeys(token)} }

// Stamp returns the stamp of res, the file at path as an engine served it.
func (s Stamper) Stamp(path string, res core.Result) Stamp { return s.keys.resultStamp(path, res) }

// storeRequest is the engine's view of a replica copy on the wire.
func storeRequest(req *fitcachepb.StoreRequest) core.StoreRequest {
	return core.StoreRequest{Root: req.Root, Path: req.Path, Data: req.Data, MTimeNanos: req.MtimeNanos,
		CTimeNanos: req.CtimeNanos, Ino: uint64(req.Inode), Checksum: uint32(req.Checksum)}
}

// Stamp is what a file's owner said of the file in a Read reply, for a replica copy of it
// (see Client.Store).
type Stamp struct {
	MTimeNanos, CTimeNanos int64
	Ino                    uint64
	Checksum               uint32
	MAC                    []byte
}

// StampOf returns the stamp of a successful Read reply.
func StampOf(r *fitcachepb.ReadReply) Stamp {
	return Stamp{MTimeNanos: r.MtimeNanos, CTimeNanos: r.CtimeNanos, Ino: uint64(r.Inode), Checksum: uint32(r.Checksum),
		MAC: r.Stamp}
}
