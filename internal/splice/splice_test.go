package splice

import (
	"bytes"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// tcpPair returns both ends of a loopback TCP connection.
func tcpPair(t *testing.T) (client, server *net.TCPConn) {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	accepted := make(chan net.Conn, 1)
	go func() {
		c, _ := l.Accept()
		accepted <- c
	}()
	c, err := net.Dial("tcp", l.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	s := <-accepted
	if s == nil {
		t.Fatal("no connection accepted")
	}
	t.Cleanup(func() { c.Close(); s.Close() })
	return c.(*net.TCPConn), s.(*net.TCPConn)
}

// unixPair returns both ends of a Unix stream socket pair.
func unixPair(t *testing.T) (a, b *net.UnixConn) {
	t.Helper()
	fds, err := syscall.Socketpair(syscall.AF_UNIX, syscall.SOCK_STREAM, 0)
	if err != nil {
		t.Fatal(err)
	}
	conn := func(fd int) *net.UnixConn {
		f := osFile(fd)
		defer f.Close()
		c, err := net.FileConn(f)
		if err != nil {
			t.Fatal(err)
		}
		return c.(*net.UnixConn)
	}
	a, b = conn(fds[0]), conn(fds[1])
	t.Cleanup(func() { a.Close(); b.Close() })
	return a, b
}

func raw(t *testing.T, c syscall.Conn) syscall.RawConn {
	t.Helper()
	r, err := c.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// Files' bytes go from a TCP connection through a pipe to a Unix socket whole and in order,
// whether they arrive in one piece, in packets of a few bytes each (more packets than the
// pipe has slots: the rest is read into memory), or with their first bytes already read by
// the caller; the pipe goes back empty and is used again.
func TestFilesGoFromATCPConnectionToAUnixSocketWhole(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	file := func(n int) []byte {
		b := make([]byte, n)
		for i := range b {
			b[i] = byte(rng.Uint32())
		}
		return b
	}
	cases := []struct {
		name    string
		size    int
		chunk   int // the sender's writes, each a packet of its own (no delay)
		already int // bytes the caller read before (Write)
	}{
		{"small", 1000, 0, 0},
		{"110KiB", 110 << 10, 0, 0},
		{"max", Max, 0, 0},
		{"first bytes read before", 110 << 10, 0, 4096},
		{"tiny packets", 40 << 10, 100, 0},
		{"empty", 0, 0, 0},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			send, recv := tcpPair(t)
			send.SetNoDelay(true)
			out, in := unixPair(t)
			want := file(tc.size)
			go func() {
				b := want
				for len(b) > 0 {
					k := len(b)
					if tc.chunk > 0 {
						k = min(k, tc.chunk)
						time.Sleep(50 * time.Microsecond)
					}
					if _, err := send.Write(b[:k]); err != nil {
						return
					}
					b = b[k:]
				}
			}()
			p, err := Get()
			if err != nil {
				t.Fatal(err)
			}
			first := make([]byte, tc.already)
			if _, err := io.ReadFull(recv, first); err != nil {
				t.Fatal(err)
			}
			if err := p.Write(first); err != nil {
				t.Fatal(err)
			}
			recv.SetReadDeadline(time.Now().Add(10 * time.Second))
			if err := p.ReadFrom(raw(t, recv), tc.size-tc.already); err != nil {
				t.Fatal(err)
			}
			if p.Len() != tc.size {
				t.Fatalf("the pipe holds %d bytes, want %d", p.Len(), tc.size)
			}
			got := make(chan []byte, 1)
			go func() {
				b := make([]byte, tc.size)
				io.ReadFull(in, b)
				got <- b
			}()
			if err := p.WriteTo(raw(t, out)); err != nil {
				t.Fatal(err)
			}
			if b := <-got; !bytes.Equal(b, want) {
				t.Fatal("the bytes read differ from those sent")
			}
			if p.Len() != 0 {
				t.Fatalf("%d bytes left in the pipe", p.Len())
			}
			Put(p)
			if again, _ := Get(); again != p {
				t.Error("an empty pipe was not used again")
			} else {
				Put(again)
			}
		})
	}
}

// A file that does not fit is refused before a byte moves, and a pipe still holding bytes
// is not used again.
func TestAPipeTakesAtMostMaxAndIsReusedOnlyEmpty(t *testing.T) {
	_, recv := tcpPair(t)
	p, err := Get()
	if err != nil {
		t.Fatal(err)
	}
	if err := p.ReadFrom(raw(t, recv), Max+1); err == nil {
		t.Fatal("a file larger than Max was taken")
	}
	if err := p.Write([]byte("left over")); err != nil {
		t.Fatal(err)
	}
	Put(p)
	q, err := Get()
	if err != nil {
		t.Fatal(err)
	}
	defer Put(q)
	if q == p || q.Len() != 0 {
		t.Fatal("a pipe holding bytes was handed out again")
	}
}

// A read waits no longer than the connection's deadline for bytes that do not come.
func TestAReadEndsAtTheDeadline(t *testing.T) {
	_, recv := tcpPair(t)
	p, err := Get()
	if err != nil {
		t.Fatal(err)
	}
	defer Put(p)
	recv.SetReadDeadline(time.Now().Add(100 * time.Millisecond))
	start := time.Now()
	if err := p.ReadFrom(raw(t, recv), 10); err == nil {
		t.Fatal("a read of bytes never sent succeeded")
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Fatalf("the read took %v", d)
	}
}

func osFile(fd int) *os.File { return os.NewFile(uintptr(fd), "socket") }

// Where the kernel (or a sandbox) refuses splice, or a splice fails for want of memory, a
// file's bytes still arrive whole, through memory, whichever splice failed; once refused,
// no pipe is handed out any more.
func TestAFailedSpliceFallsBackToMemory(t *testing.T) {
	for _, errno := range []unix.Errno{unix.EINVAL, unix.ENOMEM} {
		for _, failing := range []string{"from the socket", "to the socket"} {
			t.Run(fmt.Sprintf("%v %s", errno, failing), func(t *testing.T) {
				t.Cleanup(func() { spliceCall = unix.Splice; off.Store(false) })
				send, recv := tcpPair(t)
				out, in := unixPair(t)
				want := bytes.Repeat([]byte("refused "), 20000)
				go send.Write(want)
				p, err := Get()
				if err != nil {
					t.Fatal(err)
				}
				defer Put(p)
				spliceCall = func(rfd int, roff *int64, wfd int, woff *int64, n int, flags int) (int64, error) {
					if (failing == "from the socket") == (wfd == p.w) {
						return 0, errno
					}
					return unix.Splice(rfd, roff, wfd, woff, n, flags)
				}
				recv.SetReadDeadline(time.Now().Add(10 * time.Second))
				if err := p.ReadFrom(raw(t, recv), len(want)/2); err != nil {
					t.Fatal(err)
				}
				if err := p.ReadFrom(raw(t, recv), len(want)-len(want)/2); err != nil {
					t.Fatal(err)
				}
				got := make(chan []byte, 1)
				go func() {
					b := make([]byte, len(want))
					io.ReadFull(in, b)
					got <- b
				}()
				if err := p.WriteTo(raw(t, out)); err != nil {
					t.Fatal(err)
				}
				if !bytes.Equal(<-got, want) {
					t.Fatal("the bytes read differ from those sent")
				}
				q, err := Get()
				if err == nil {
					Put(q)
				}
				if refusedNow := err != nil; refusedNow != (errno == unix.EINVAL) {
					t.Errorf("after %v, pipes refused: %v", errno, refusedNow)
				}
			})
		}
	}
}

// A connection that ends in a file's bytes fails the read at once, not at its deadline,
// whether its bytes came in one piece or in more packets than the pipe has slots.
func TestAConnectionEndingInAFileFailsTheReadAtOnce(t *testing.T) {
	for _, chunk := range []int{0, 100} {
		t.Run(fmt.Sprintf("packets of %d bytes", chunk), func(t *testing.T) {
			send, recv := tcpPair(t)
			send.SetNoDelay(true)
			sent := bytes.Repeat([]byte("x"), 40<<10)
			go func() {
				for b := sent; len(b) > 0; {
					k := len(b)
					if chunk > 0 {
						k = min(k, chunk)
						time.Sleep(20 * time.Microsecond)
					}
					send.Write(b[:k])
					b = b[k:]
				}
				send.Close()
			}()
			p, err := Get()
			if err != nil {
				t.Fatal(err)
			}
			defer Put(p)
			recv.SetReadDeadline(time.Now().Add(30 * time.Second))
			start := time.Now()
			if err := p.ReadFrom(raw(t, recv), len(sent)+1000); err == nil {
				t.Fatal("a read past the connection's end succeeded")
			}
			if d := time.Since(start); d > 10*time.Second {
				t.Fatalf("the read failed after %v", d)
			}
		})
	}
}
