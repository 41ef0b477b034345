package core

import (
	"errors"
	"fmt"
	"time"

	"github.com/fitcache/fitcache/tiers"
)

// MemoryAtExit says what becomes of the memory tiers' copies when a server exits.
type MemoryAtExit string

// What a server may do with its memory tiers as it exits. A server killed (SIGKILL) does
// none: `fitcache clear --node` removes what it left (a site's job epilog runs it).
const (
	// MemoryKeep leaves the copies for the next server of the user on the node: its first
	// epoch is warm, and the RAM stays taken until then.
	MemoryKeep MemoryAtExit = "keep"
	// MemoryClear removes them, with the tier's index: no RAM is held after the server.
	MemoryClear MemoryAtExit = "clear"
	// MemoryToDisk moves them to the next tier that takes them (the disk tier), for at most
	// MoveAtExitMax, and removes the rest: the next server starts warm from disk.
	MemoryToDisk MemoryAtExit = "disk"
)

// MoveAtExitMax bounds MemoryToDisk's moving: a batch system sends SIGTERM at a job's end
// and SIGKILL some seconds later (Slurm's KillWait, 30 s by default).
const MoveAtExitMax = 20 * time.Second

// ParseMemoryAtExit parses "keep", "clear" or "disk".
func ParseMemoryAtExit(s string) (MemoryAtExit, error) {
	switch m := MemoryAtExit(s); m {
	case MemoryKeep, MemoryClear, MemoryToDisk:
		return m, nil
	}
	return "", fmt.Errorf("%q is none of keep, clear, disk", s)
}

// leaveMemory does with the memory tiers what e.atExit says (Close, with the mover stopped),
// once: a second Close finds the tiers closed.
func (e *Engine) leaveMemory() error {
	if e.atExit == "" || e.atExit == MemoryKeep || !e.leftMemory.CompareAndSwap(false, true) {
		return nil
	}
	var errs []error
	for i, t := range e.tiers {
		if t.Kind != tiers.Memory {
			continue
		}
		before := t.Info()
		if e.atExit == MemoryToDisk {
			e.moveOut(i)
		}
		if err := t.Drop(); err != nil {
			errs = append(errs, fmt.Errorf("memory tier %s: %w", t.Path, err))
		}
		e.log.Info("memory tier emptied as the server exits", "tier", t.Path, "policy", string(e.atExit),
			"files", before.Files, "bytes", before.Used)
	}
	return errors.Join(errs...)
}

// moveOut moves the copies of tier i to the tiers after it, oldest first, a step of
// moveStep bytes at a time, until none is left or MoveAtExitMax has passed (Drop removes the
// rest).
func (e *Engine) moveOut(i int) {
	spill := e.spillFrom(i)
	if spill == nil {
		return
	}
	t := e.tiers[i]
	for deadline := time.Now().Add(MoveAtExitMax); time.Now().Before(deadline); {
		used := t.Info().Used
		if used == 0 {
			return
		}
		if _, err := t.Ceil(max(used-moveStep, 0), "server exiting", spill); err != nil {
			e.log.Warn("moving the memory tier out", "tier", t.Path, "err", err)
			return
		}
		if t.Info().Used >= used {
			return // what is left is being written
		}
	}
	e.log.Warn("the memory tier was not moved out whole within the time allowed", "tier", t.Path,
		"left", tiers.FormatBytes(t.Info().Used), "allowed", MoveAtExitMax)
}

// moveStep is what moveOut moves between two looks at the clock.
const moveStep = 64 << 20
