// Command capi builds libfitcache.so, the C interface of FitCache (go build
// -buildmode=c-shared). fitcache.h is the contract; fitcache.c holds the fc_* entry points,
// which check the fork guard and call the Go exports below. This is the only package main
// with exports.
//
// Rules kept by every export: handles are integers from a mutex-guarded registry (unknown
// ones give -EBADF); results are 0 or -errno, with the message stored for fc_errmsg; panics
// are recovered into -EIO.
package main

/*
#cgo CFLAGS: -Wall -Wextra -Wno-unused-parameter
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "hitpath.h"
void fcSetErrmsg(const char *msg);
const char *fcLibraryPath(void);
*/
import "C"

import (
	"encoding/json"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"syscall"
	"time"
	"unsafe"

	"github.com/fitcache/fitcache/client"
	"github.com/fitcache/fitcache/config"
	"github.com/fitcache/fitcache/core"
	"github.com/fitcache/fitcache/rpc"
)

func main() {}

func init() { rpc.QuietKitexLogs() }

// registry maps integer handles to Go objects, so that C never holds a Go pointer. Each
// registry hands out handles from its own range [first, limit), so that a handle of one kind
// (a buffer) is never valid as another (a client): using it gives EBADF. The zero value hands
// out 1, 2, 3...
type registry[T any] struct {
	first, limit int64      // the range of handles (limit 0: no limit); set before use
	mu           sync.Mutex // protects next and objs
	next         int64      // the last handle given out, or 0
	objs         map[int64]T
}

var errTooManyHandles = fmt.Errorf("%w: out of fitcache handles", syscall.EMFILE)

func (r *registry[T]) add(v T) (int64, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.objs == nil {
		r.objs = make(map[int64]T)
	}
	if r.next < r.first {
		r.next = r.first - 1
	}
	if r.limit != 0 && r.next+1 >= r.limit {
		return 0, errTooManyHandles
	}
	r.next++
	r.objs[r.next] = v
	return r.next, nil
}

func (r *registry[T]) get(h int64) (T, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	v, ok := r.objs[h]
	return v, ok
}

func (r *registry[T]) remove(h int64) (T, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	v, ok := r.objs[h]
	delete(r.objs, h)
	return v, ok
}

// len returns the number of live handles.
func (r *registry[T]) len() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.objs)
}

// buffer is what fc_read handed out: a mapping, or C memory holding bytes that were in Go
// memory (C may not keep pointers to Go memory).
type buffer struct {
	mapping client.Buffer  // nil for C memory
	cmem    unsafe.Pointer // from C.malloc, or nil
}

// Client handles are 1 to 2^40-1, buffer handles 2^40 to 2^62-1: disjoint, so that fc_close
// of a buffer, or fc_release of a client, is -EBADF and touches nothing.
var (
	clients = registry[*client.Client]{first: 1, limit: 1 << 40}
	buffers = registry[buffer]{first: 1 << 40, limit: 1 << 62}
)

var log = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn})).With("lib", "fitcache")

// fail stores err's message for fc_errmsg and returns its negated errno.
func fail(err error) C.int {
	msg := C.CString(err.Error())
	C.fcSetErrmsg(msg)
	C.free(unsafe.Pointer(msg))
	return -C.int(core.Errno(err))
}

// guard recovers a panic into -EIO; every export defers it.
func guard(rc *C.int) {
	if r := recover(); r != nil {
		*rc = fail(fmt.Errorf("%w: internal error: %v", syscall.EIO, r))
	}
}

var errBadHandle = fmt.Errorf("%w: unknown fitcache handle", syscall.EBADF)

// lookupClient returns the client behind a handle, or errBadHandle.
func lookupClient(handle C.int64_t) (*client.Client, error) {
	c, ok := clients.get(int64(handle))
	if !ok {
		return nil, errBadHandle
	}
	return c, nil
}

//export goOpen
func goOpen(root, optionsJSON *C.char, handle *C.int64_t) (rc C.int) {
	defer guard(&rc)
	opts := map[string]string{}
	if optionsJSON != nil {
		if err := json.Unmarshal([]byte(C.GoString(optionsJSON)), &opts); err != nil {
			return fail(fmt.Errorf("%w: options must be a JSON object of strings: %v", syscall.EINVAL, err))
		}
	}
	cfg, err := config.Load(opts)
	if err != nil {
		return fail(fmt.Errorf("%w: %v", syscall.EINVAL, err))
	}
	if cfg.ServerBin == "" {
		cfg.ServerBin = serverBinBesideLibrary()
	}
	c, err := client.Open(C.GoString(root), cfg, log)
	if err != nil {
		return fail(err)
	}
	h, err := clients.add(c)
	if err != nil {
		c.Close()
		return fail(err)
	}
	c.SetExternalCounts(func() client.ExternalCounts {
		var n, fetches, direct, sourceRanges C.int64_t
		C.fcHitCounts(C.int64_t(h), &n, &fetches, &direct, &sourceRanges)
		return client.ExternalCounts{Hits: int64(n), Fetches: int64(fetches), Direct: int64(direct),
			SourceRanges: int64(sourceRanges), Fills: int64(C.fcHitFilled(C.int64_t(h))),
			ParallelMisses: int64(C.fcHitParallelMisses(C.int64_t(h)))}
	})
	// The hit path asks the node socket to fetch a miss into a tier and then finds it there
	// itself (OpFetch). In cluster mode that is the socket of this node's server, which
	// fetches a file another node owns from its owner into a node-local copy, and opens for
	// the reader (OpOpen) one it has no room for: the hit path asks it to (node_opens). A
	// client on a node without a server of the job reads through Go (NodeSocket is "").
	croot, creal, cnode := C.CString(c.Root()), C.CString(c.RealRoot()), C.CString(c.NodeSocket())
	defer C.free(unsafe.Pointer(croot))
	defer C.free(unsafe.Pointer(creal))
	defer C.free(unsafe.Pointer(cnode))
	if C.fcHitOpen(C.int64_t(h), croot, creal, cnode, C.int64_t(cfg.ReadTimeout.Milliseconds()), C.bool(cfg.Servers != "")) == 0 {
		addHitTiers(h, c)
		c.SetOnServerState(func(up bool, backoff time.Duration) {
			C.fcHitServerState(C.int64_t(h), C.bool(up), C.int64_t(backoff.Milliseconds()))
		})
	}
	*handle = C.int64_t(h)
	return 0
}

// addHitTiers hands the tier directories of a client's server to the hit path (capi/clients.c),
// which then serves cached files without entering Go.
func addHitTiers(h int64, c *client.Client) {
	C.fcHitSetBlockBytes(C.int64_t(h), C.int64_t(c.BlockBytes()))
	C.fcHitSetFills(C.int64_t(h), C.bool(c.ReaderFills()))
	for _, d := range c.TierDirs() {
		dir := C.CString(d.Path)
		if rc := C.fcHitAddTier(C.int64_t(h), dir, C.int(d.Kind), C.uint32_t(d.Session())); rc != 0 && rc != -C.int(syscall.EBADF) {
			log.Warn("tier not used by the C hit path; its files are read through Go", "dir", d.Path, "errno", -rc)
		}
		C.free(unsafe.Pointer(dir))
	}
}

// refreshMu serialises goRefreshTiers, so that racing readers add a client's tiers once.
var refreshMu sync.Mutex

// goRefreshTiers gives the hit path the tiers of a client that had none when it opened (its
// server was not up yet, say); fc_read calls it after a read through Go.
//
//export goRefreshTiers
func goRefreshTiers(handle C.int64_t) {
	defer func() { recover() }()
	refreshMu.Lock()
	defer refreshMu.Unlock()
	if c, ok := clients.get(int64(handle)); ok && C.fcHitTiers(handle) == 0 {
		addHitTiers(int64(handle), c)
	}
}

// serverBinBesideLibrary finds the fitcache executable installed with the library
// (bin/fitcache next to libfitcache.so), or returns "" to look it up on PATH.
func serverBinBesideLibrary() string {
	lib := C.GoString(C.fcLibraryPath())
	if lib == "" {
		return ""
	}
	bin := filepath.Join(filepath.Dir(lib), "bin", "fitcache")
	if fi, err := os.Stat(bin); err == nil && fi.Mode()&0o111 != 0 {
		return bin
	}
	return ""
}

//export goClose
func goClose(handle C.int64_t) (rc C.int) {
	defer guard(&rc)
	c, ok := clients.remove(int64(handle))
	if !ok {
		return fail(errBadHandle)
	}
	C.fcHitClose(handle)
	if err := c.Close(); err != nil {
		return fail(err)
	}
	return 0
}

//export goRead
func goRead(handle C.int64_t, path *C.char, data *unsafe.Pointer, size *C.int64_t, bufID *C.int64_t) (rc C.int) {
	defer guard(&rc)
	c, err := lookupClient(handle)
	if err != nil {
		return fail(err)
	}
	ptr, n, id, err := readExported(c, C.GoString(path))
	if err != nil {
		return fail(err)
	}
	*data, *size, *bufID = ptr, C.int64_t(n), C.int64_t(id)
	return 0
}

// readExported reads a file and hands it out as a registered buffer: the mapping itself when
// the bytes are mapped, else a copy in C memory (C may not keep pointers to Go memory).
func readExported(c *client.Client, path string) (ptr unsafe.Pointer, size int, id int64, err error) {
	buf, err := c.Read(path)
	if err != nil {
		return nil, 0, 0, err
	}
	return exportBuffer(buf)
}

// exportBuffer registers a buffer for C (see readExported).
func exportBuffer(buf client.Buffer) (ptr unsafe.Pointer, size int, id int64, err error) {
	b := buf.Bytes()
	var out buffer
	switch {
	case len(b) == 0:
		buf.Release()
	case client.IsMapped(buf):
		out.mapping = buf
		ptr = unsafe.Pointer(&b[0]) // mapped memory, outside the Go heap
	default:
		out.cmem = C.malloc(C.size_t(len(b)))
		if out.cmem == nil {
			buf.Release()
			return nil, 0, 0, fmt.Errorf("%w: out of memory for %d bytes", syscall.ENOMEM, len(b))
		}
		C.memcpy(out.cmem, unsafe.Pointer(&b[0]), C.size_t(len(b)))
		ptr = out.cmem
		buf.Release()
	}
	if id, err = buffers.add(out); err != nil {
		releaseBuffer(out)
		return nil, 0, 0, err
	}
	return ptr, len(b), id, nil
}

// readManyConcurrency bounds the files of one fc_read_many read at once: misses then wait
// on the source together, hits cost no more than read one by one.
const readManyConcurrency = 8

//export goReadMany
func goReadMany(handle C.int64_t, count C.int, paths **C.char, data *unsafe.Pointer, sizes *C.int64_t,
	bufIDs *C.int64_t, results *C.int) (rc C.int) {
	defer guard(&rc)
	c, err := lookupClient(handle)
	if err != nil {
		return fail(err)
	}
	n := int(count)
	pathv := unsafe.Slice(paths, n)
	datav, sizev, idv, resv := unsafe.Slice(data, n), unsafe.Slice(sizes, n), unsafe.Slice(bufIDs, n), unsafe.Slice(results, n)
	goPaths := make([]string, n) // C strings are read before any goroutine starts
	for i := range pathv {
		goPaths[i] = C.GoString(pathv[i])
		datav[i], sizev[i], idv[i], resv[i] = nil, 0, 0, -C.int(syscall.EIO)
	}
	next := make(chan int, n) // filled up front: a worker that stops early blocks no one
	for i := range n {
		next <- i
	}
	close(next)
	var wg sync.WaitGroup
	var firstErr error
	var errOnce sync.Once
	for range min(n, readManyConcurrency) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer func() {
				if r := recover(); r != nil {
					errOnce.Do(func() { firstErr = fmt.Errorf("%w: internal error: %v", syscall.EIO, r) })
				}
			}()
			for i := range next {
				ptr, size, id, err := fetchExported(handle, c, goPaths[i])
				if err != nil {
					datav[i], sizev[i], idv[i], resv[i] = nil, 0, 0, -C.int(core.Errno(err))
					continue
				}
				datav[i], sizev[i], idv[i], resv[i] = ptr, C.int64_t(size), C.int64_t(id), 0
			}
		}()
	}
	wg.Wait()
	if firstErr != nil { // hand nothing out: release what was read
		for i := range n {
			if resv[i] == 0 && idv[i] != 0 {
				if b, ok := buffers.remove(int64(idv[i])); ok {
					releaseBuffer(b)
				}
			}
		}
		return fail(firstErr)
	}
	return 0
}

// fetchExported is readExported for a file that the server may put into a tier: the hit
// path then reads it from there (one copy, or a mapping for a large file) instead of Go
// mapping it.
func fetchExported(handle C.int64_t, c *client.Client, path string) (ptr unsafe.Pointer, size int, id int64, err error) {
	cached, buf, err := c.Fetch(path)
	if err != nil {
		return nil, 0, 0, err
	}
	if cached {
		cpath := C.CString(path)
		defer C.free(unsafe.Pointer(cpath))
		var data unsafe.Pointer
		var n, bufID C.int64_t
		switch rc := C.hit_read_fetched(handle, cpath, &data, &n, &bufID); rc {
		case 0:
			return data, int(n), int64(bufID), nil
		case C.FC_MISS: // evicted at once: read it the usual way
			return readExported(c, path)
		default:
			return nil, 0, 0, fmt.Errorf("%w: reading %s from its tier", syscall.Errno(-rc), path)
		}
	}
	return exportBuffer(buf)
}

//export goServerUnavailable
func goServerUnavailable(handle C.int64_t) {
	defer func() { recover() }()
	if c, ok := clients.get(int64(handle)); ok {
		c.MarkUnavailable()
	}
}

//export goRelease
func goRelease(bufID C.int64_t) (rc C.int) {
	defer guard(&rc)
	b, ok := buffers.remove(int64(bufID))
	if !ok {
		return fail(fmt.Errorf("%w: unknown or released fitcache buffer %d", syscall.EBADF, int64(bufID)))
	}
	if err := releaseBuffer(b); err != nil {
		return fail(err)
	}
	return 0
}

// releaseBuffer frees a buffer's C memory or unmaps its mapping.
func releaseBuffer(b buffer) error {
	if b.cmem != nil {
		C.free(b.cmem)
	}
	if b.mapping != nil {
		return b.mapping.Release()
	}
	return nil
}

//export goDebugOpenHandles
func goDebugOpenHandles(nClients, nBuffers *C.int64_t) (rc C.int) {
	defer guard(&rc)
	if nClients != nil {
		*nClients = C.int64_t(clients.len())
	}
	if nBuffers != nil {
		*nBuffers = C.int64_t(buffers.len())
	}
	return 0
}

//export goPread
func goPread(handle C.int64_t, path *C.char, buf unsafe.Pointer, length, off C.int64_t) (rc C.int64_t) {
	defer func() {
		if r := recover(); r != nil {
			rc = C.int64_t(fail(fmt.Errorf("%w: internal error: %v", syscall.EIO, r)))
		}
	}()
	c, err := lookupClient(handle)
	if err != nil {
		return C.int64_t(fail(err))
	}
	dst := unsafe.Slice((*byte)(buf), int(length))
	name := C.GoString(path)
	n, err := c.ReadAt(name, dst, int64(off))
	// The C hit path reads cached blocks itself: tell it the block size of the server this
	// client reached last (it may have restarted with another), and its tiers if it had none.
	C.fcHitSetBlockBytes(handle, C.int64_t(c.BlockBytes()))
	if C.fcHitTiers(handle) == 0 {
		goRefreshTiers(handle)
	}
	// A large file whose blocks the server has no room for: the hit path reads the ranges of
	// its blocks not cached from its source itself, for a while (see Client.DeclinedSource).
	if abs, err := c.Resolve(name); err == nil {
		if fd, until, ok := c.DeclinedSource(abs); ok {
			cpath := C.CString(abs)
			C.fcHitSetSource(handle, cpath, C.int(fd), C.int64_t(time.Until(until).Milliseconds())) // C owns fd
			C.free(unsafe.Pointer(cpath))
		}
	}
	if err != nil {
		return C.int64_t(fail(err))
	}
	return C.int64_t(n)
}

//export goSize
func goSize(handle C.int64_t, path *C.char, size *C.int64_t) (rc C.int) {
	defer guard(&rc)
	c, err := lookupClient(handle)
	if err != nil {
		return fail(err)
	}
	n, err := c.Size(C.GoString(path))
	if err != nil {
		return fail(err)
	}
	*size = C.int64_t(n)
	return 0
}

//export goCheckServer
func goCheckServer(handle C.int64_t) (rc C.int) {
	defer guard(&rc)
	c, err := lookupClient(handle)
	if err != nil {
		return fail(err)
	}
	if err := c.CheckServer(); err != nil {
		return fail(err)
	}
	if C.fcHitTiers(handle) == 0 {
		addHitTiers(int64(handle), c)
	}
	// In cluster mode, the processes forked next ask the node's server for what the tiers do
	// not hold while one answers, else the client's stand-in (client/standin.go).
	socket, inCluster, err := c.ForkedReaders()
	switch {
	case err != nil:
		log.Warn("no fitcache server of this node answers, and no stand-in: readers forked from this process "+
			"read the source for what the tiers do not hold", "err", err)
	case inCluster && socket == "":
		C.fcHitUseStandIn(handle, nil)
	case inCluster:
		path := C.CString(socket)
		defer C.free(unsafe.Pointer(path))
		C.fcHitUseStandIn(handle, path)
	}
	return 0
}

//export goStats
func goStats(handle C.int64_t, buf *C.char, length C.size_t, needed *C.size_t) (rc C.int) {
	defer guard(&rc)
	c, err := lookupClient(handle)
	if err != nil {
		return fail(err)
	}
	js, err := c.Stats()
	if err != nil {
		return fail(err)
	}
	if needed != nil {
		*needed = C.size_t(len(js) + 1)
	}
	if C.size_t(len(js)+1) > length {
		return fail(fmt.Errorf("%w: stats need %d bytes", syscall.ERANGE, len(js)+1))
	}
	dst := unsafe.Slice((*byte)(unsafe.Pointer(buf)), len(js)+1)
	copy(dst, js)
	dst[len(js)] = 0
	return 0
}
