package rpc

import (
	"fmt"

	"github.com/cloudwego/gopkg/protocol/thrift"

	"github.com/fitcache/fitcache/internal/splice"
	"github.com/fitcache/fitcache/rpc/kitex_gen/fitcachepb"
)

// PipeSink, given to Client.ReadBatch, takes the bytes of the reply's files of at most
// splice.Max bytes into pipes (package splice) instead of the caller's buffer: a server that
// sends them on to a reader's socket never has them in its memory. A file for which no pipe
// can be had, or a larger one, is read into the buffer as without a sink. Over a connection
// that is no socket of the standard library's every file is.
type PipeSink struct {
	pipes []*splice.Pipe // by reply; nil: the file's bytes are in the reply's Data (or it has none)
}

// Take returns the pipe holding the bytes of the reply's i-th file, or nil when they are in
// the reply's Data (or it has none). The caller owns the pipe (splice.Put).
func (s *PipeSink) Take(i int) *splice.Pipe {
	if !s.Piped(i) {
		return nil
	}
	p := s.pipes[i]
	s.pipes[i] = nil
	return p
}

// Piped reports whether the bytes of the reply's i-th file are in a pipe, not taken yet (s
// may be nil: none is).
func (s *PipeSink) Piped(i int) bool {
	return s != nil && i >= 0 && i < len(s.pipes) && s.pipes[i] != nil
}

// Close gives back the pipes not taken: the files whose bytes nobody sent on (s may be nil).
func (s *PipeSink) Close() {
	if s == nil {
		return
	}
	for i, p := range s.pipes {
		splice.Put(p)
		s.pipes[i] = nil
	}
}

// read reads the data of a ReadBatch reply, n bytes, from in: each file's bytes into a pipe
// of its own where one can be had, the others one after the other into the call's buffer
// (dest), which it returns. frame is the reply up to its data (the data's length set to 0):
// its replies say how long each file is, and in what order the files come.
func (s *PipeSink) read(in *buffer, frame []byte, n int, dest *bulkDest) ([]byte, error) {
	sizes, err := batchSizes(frame, n)
	if err != nil {
		return nil, err
	}
	buf, lent := dest.lendAll()
	if !lent { // the caller is gone, with its sink: the bytes are read to be dropped
		data := make([]byte, n)
		return data, in.readDirect(data)
	}
	defer dest.give()
	s.pipes = make([]*splice.Pipe, len(sizes))
	inMemory := 0
	for i, size := range sizes {
		if size > 0 && size <= splice.Max {
			if p, err := splice.Get(); err == nil {
				s.pipes[i] = p
				continue
			}
		}
		inMemory += size
	}
	if cap(buf) < inMemory {
		buf = make([]byte, inMemory)
	}
	data := buf[:inMemory]
	at := 0
	for i, size := range sizes {
		if p := s.pipes[i]; p != nil {
			err = in.readDirectPipe(p, size)
		} else {
			err = in.readDirect(data[at : at+size])
			at += size
		}
		if err != nil {
			s.Close()
			return nil, err
		}
	}
	return data, nil
}

// batchSizes returns the size of each file's bytes in the data of a ReadBatch reply, by
// reply (0 for a file that failed), from frame, the reply's message up to its data (the
// data's length, n, set to 0): decoded ending there, as the whole message is once read (the data
// is the reply's last field, see encodeBatch).
func batchSizes(frame []byte, n int) ([]int, error) {
	msg := append(frame[:len(frame):len(frame)], byte(thrift.STOP), byte(thrift.STOP))
	if err := checkFrame(msg); err != nil {
		return nil, err
	}
	c := &frameCheck{b: msg}
	if _, err := c.take(4); err != nil { // version and type, checked
		return nil, err
	}
	name, err := c.u32()
	if err != nil {
		return nil, err
	}
	if _, err := c.take(int(name) + 4); err != nil { // the method and the sequence id
		return nil, err
	}
	var result fitcachepb.FitCacheReadBatchResult
	if _, err := result.FastRead(msg[c.off:]); err != nil {
		return nil, fmt.Errorf("%w: %w", errBadFrame, err)
	}
	if result.Success == nil {
		return nil, fmt.Errorf("%w: a batch's data without its replies", errBadFrame)
	}
	sizes, total := make([]int, len(result.Success.Replies)), 0
	for i, r := range result.Success.Replies {
		if r == nil || r.Errno != 0 {
			continue
		}
		if r.Size < 0 || r.Size > int64(n) {
			return nil, fmt.Errorf("%w: a file of %d bytes in a batch", errBadFrame, r.Size)
		}
		sizes[i] = int(r.Size)
		total += sizes[i]
	}
	if total != n {
		return nil, fmt.Errorf("%w: the batch's data holds %d bytes, its files %d", errBadFrame, n, total)
	}
	return sizes, nil
}
