package main

import (
	"flag"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"github.com/fitcache/fitcache/client"
	"github.com/fitcache/fitcache/core"
	"github.com/fitcache/fitcache/rpc"
	"github.com/fitcache/fitcache/tiers"
)

// warmup caches every file under a directory: it hands the list to the servers as a
// prefetch job (the machinery readers use, see core.Engine.Prefetch), follows it until it
// ends and reports. A server whose prefetch is off is warmed by reading the files through it.
func warmup(args []string) error {
	rpc.QuietKitexLogs()
	fset := flag.NewFlagSet("warmup", flag.ExitOnError)
	workers := fset.Int("workers", 8, "files read at once when the server does not prefetch (its option prefetch sets how many it reads at once)")
	quiet := fset.Bool("quiet", false, "no progress line")
	fset.Parse(args)
	if fset.NArg() != 1 {
		return fmt.Errorf("usage: fitcache warmup [--workers N] [--quiet] DIR")
	}
	c, err := openClient(fset.Arg(0))
	if err != nil {
		return err
	}
	defer c.Close()
	var files []string
	err = filepath.WalkDir(c.Root(), func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.Type().IsRegular() {
			files = append(files, p)
		}
		return nil
	})
	if err != nil {
		return err
	}
	sort.Strings(files)
	start := time.Now()
	if err := c.Prefetch(files); err != nil {
		return err
	}
	info := c.PrefetchStatus()
	if info.State == core.PrefetchOff {
		fmt.Fprintf(os.Stderr, "warmup: the server does not prefetch (option prefetch 0): reading the files through it, %d at once\n", *workers)
		return readThrough(c, files, *workers, *quiet)
	}
	info = follow(c, "warmup", *quiet)
	fmt.Fprintf(os.Stderr, "warmup: %d files in %s: %s\n", len(files), time.Since(start).Round(time.Millisecond), describe(info))
	switch {
	case info.Failed > 0:
		return fmt.Errorf("%d of %d files failed", info.Failed, len(files))
	case info.State != core.PrefetchDone && info.State != core.PrefetchBudget:
		return fmt.Errorf("the prefetch job ended before the list did (%s)", info.State)
	}
	return nil
}

// readThrough reads every file through the cache, workers at a time, with a progress line.
func readThrough(c *client.Client, files []string, workers int, quiet bool) error {
	var done, bytes, failed atomic.Int64
	start := time.Now()
	progress := func(final bool) {
		if quiet && !final {
			return
		}
		el := time.Since(start).Seconds()
		rate := float64(bytes.Load()) / max(el, 1e-9)
		eta := ""
		if n := done.Load(); n > 0 && !final {
			eta = fmt.Sprintf(", eta %s", time.Duration(float64(len(files)-int(n))*el/float64(n)*float64(time.Second)).Round(time.Second))
		}
		end := "\r"
		if final {
			end = "\n"
		}
		fmt.Fprintf(os.Stderr, "warmup: %d/%d files, %s, %s/s, %d failed%s   %s",
			done.Load(), len(files), tiers.FormatBytes(bytes.Load()), tiers.FormatBytes(int64(rate)), failed.Load(), eta, end)
	}
	next := make(chan string)
	var wg sync.WaitGroup
	for range max(workers, 1) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for p := range next {
				buf, err := c.Read(p)
				if err != nil {
					failed.Add(1)
					fmt.Fprintf(os.Stderr, "\nwarmup: %s: %v\n", p, err)
				} else {
					bytes.Add(int64(len(buf.Bytes())))
					buf.Release()
				}
				done.Add(1)
			}
		}()
	}
	tick := time.NewTicker(500 * time.Millisecond)
	defer tick.Stop()
	for _, p := range files {
		select {
		case next <- p:
		case <-tick.C:
			progress(false)
			next <- p
		}
	}
	close(next)
	wg.Wait()
	progress(true)
	if failed.Load() > 0 {
		return fmt.Errorf("%d of %d files failed", failed.Load(), len(files))
	}
	return nil
}
