package core

import (
	"errors"
	"fmt"
	"io/fs"
	"time"

	"github.com/fitcache/fitcache/tiers"
)

// Fills by readers (see tiers.Claim): a reader on this node that misses a small file reads
// it from the source itself, writes its copy into the first tier, and reports it here
// (RecordFill, through the node socket, without waiting for an answer). The engine checks
// the report and records the copy; a fill of its own first claims the file as readers do, and
// waits for a reader that holds the claim (claimSource).

// FillReport is what a reader says of a file it read from the source and wrote into the first
// tier's fill file (tiers.FillName): the source's identity as it read it (fstat of its open
// source, unchanged after the read), the source's permission bits, the fill file's inode,
// and, from a reader that computed it, the CRC-32C of the bytes it wrote there.
type FillReport struct {
	Identity    tiers.Identity
	Mode        fs.FileMode
	FillIno     uint64
	Checksum    uint32 // when HasChecksum (see tiers.Fill)
	HasChecksum bool
}

// RecordFill records a reader's fill of the file at path (in root) as its cached copy (see
// NoteReport for a report noted as it arrived): the
// source is looked at once more (one stat, as a copy's check), the fill file must be what the
// report says, and the copy takes room as a fill of the engine's own would (evicting, or in a
// later tier). Its checksum is the one reported, when it is (the copy is not read again, see
// tiers.Fill). A fill that is not recorded is removed. The file counts as read from the source
// once, as the engine's own fills do.
func (e *Engine) RecordFill(root, path string, r FillReport) error {
	if e.closed.Load() {
		return ErrClosed
	}
	if len(e.tiers) == 0 {
		return fmt.Errorf("%w: no tier", ErrTooLarge)
	}
	first := e.tiers[0]
	e.noteFillRoot(root)
	adopted, err := e.recordFill(first, root, path, r)
	if !adopted { // else Adopt ended the claim
		first.RemoveFill(path, r.FillIno)
	}
	if errors.Is(err, ErrCacheFull) || errors.Is(err, tiers.ErrNoRoom) || (err == nil && !first.Listed(path)) {
		// No room in the first tier (the copy went to a later one, or nowhere): readers
		// stop writing fill files into it for a while. Each one takes memory until it is
		// recorded, and reports can queue up behind a slower tier's copies.
		first.MarkFull(root)
	}
	if errors.Is(err, ErrCacheFull) || errors.Is(err, tiers.ErrNoRoom) {
		e.warnFull(root) // no tier took it
	}
	if e.reported(path) {
		e.recorded(path)
	}
	if err != nil {
		e.stats.fillsRefused.Add(1)
		return err
	}
	e.stats.readerFills.Add(1)
	e.stats.misses.Add(1)
	e.stats.published.Add(1)
	e.stats.sourceReads.Add(1)
	e.stats.sourceBytes.Add(r.Identity.Size)
	return nil
}

// recordFill is RecordFill but for the claim's end: adopted says whether the fill file was
// published as it is, its claim ended (tiers.Tier.Adopt).
func (e *Engine) recordFill(first *tiers.Tier, root, path string, r FillReport) (adopted bool, err error) {
	if err := e.checkRoot(root, path); err != nil {
		return false, err
	}
	session := e.sessions.current()
	now, err := e.sourceIdentity(root, path, session)
	if err != nil {
		return false, err
	}
	if now != r.Identity {
		return false, fmt.Errorf("%w: %s changed since its reader read it", tiers.ErrBadFill, path)
	}
	f, err := first.OpenFill(path, r.FillIno, r.Identity.Size)
	if err != nil {
		return false, err
	}
	defer f.Close()
	f.Checksum, f.HasChecksum = r.Checksum, r.HasChecksum
	entry := tiers.Entry{SourcePath: path, Size: r.Identity.Size, MTimeNanos: r.Identity.MTimeNanos,
		SourceCTimeNanos: r.Identity.CTimeNanos, SourceIno: r.Identity.Ino, Session: session, Group: root,
		Mode: r.Mode.Perm()}
	if !e.canCache(entry) {
		return false, fmt.Errorf("%w: %s (%d bytes) fits in no tier", ErrTooLarge, path, entry.Size)
	}
	if e.fullFor(root) {
		e.warnFull(root)
		return false, fmt.Errorf("%w: %s", ErrCacheFull, path)
	}
	err = e.place(0, entry, content{fill: f, fillTier: first})
	return f.Adopted(), err
}

// claimWaitMax bounds claimSource's wait for the holder of a file's claim: a reader that
// holds it (locked) longer, stopped or hung, is not waited for; the source is read anyway.
// It exceeds tiers.AbandonedAfter, so that an abandoned claim is taken over, not ignored.
// claimPoll is how often it looks.
const (
	claimWaitMax = 10 * time.Second
	claimPoll    = time.Millisecond
)

// errFilledByReader reports that a reader filled the file while a fill of the engine waited.
var errFilledByReader = errors.New("filled by a reader")

// errClaimedByReader ends a flight of prefetch alone that found a reader's claim: the reader
// caches the file, and prefetch goes on to the next instead of waiting (see
// giveUpIfPrefetchOnly).
var errClaimedByReader = errors.New("being filled by a reader")

// claimSource claims the file at path before the engine reads it from the source (see
// tiers.Claim), for the flight f. A flight of prefetch alone that finds the claim taken is
// given up (errClaimedByReader). Otherwise, while another process holds the claim it waits: for a reader reading the
// source (its fill file locked), or for the record of a fill it reported (NoteReport). It
// returns errFilledByReader when the copy is cached meanwhile. A claim left by a reader that
// neither holds it nor reported it for tiers.AbandonedAfter (it died) is taken over. The claim is zero (nothing to
// release) when there is no tier, when the tier's file system refuses the claim's file, or
// when the holder did not finish within claimWaitMax: then the source is read anyway.
func (e *Engine) claimSource(path string, f *flight) (tiers.Claim, error) {
	if len(e.tiers) == 0 {
		return tiers.Claim{}, nil
	}
	first := e.tiers[0]
	deadline := time.Now().Add(claimWaitMax)
	var unlockedSince time.Time // when the claim was first seen neither locked nor reported
	for {
		c, err := first.Claim(path)
		switch {
		case err == nil:
			if e.listed(path) { // recorded between the caller's look and the claim
				c.Release()
				return tiers.Claim{}, errFilledByReader
			}
			return c, nil
		case !errors.Is(err, tiers.ErrClaimed):
			return tiers.Claim{}, nil
		case e.giveUpIfPrefetchOnly(path, f):
			return tiers.Claim{}, errClaimedByReader
		case e.listed(path):
			return tiers.Claim{}, errFilledByReader
		case time.Now().After(deadline):
			e.log.Warn("read a file whose claim was not given up", "file", path, "after", claimWaitMax)
			return tiers.Claim{}, nil
		}
		if state, _ := first.ClaimStateOf(path); state == tiers.Held || e.reported(path) {
			unlockedSince = time.Time{}
		} else if unlockedSince.IsZero() {
			unlockedSince = time.Now()
		} else if time.Since(unlockedSince) >= tiers.AbandonedAfter && first.TakeAbandonedClaim(path) {
			continue
		}
		time.Sleep(claimPoll)
	}
}

// NoteReport notes that a reader reported its fill of the file at path, which RecordFill
// will record: until then, its claim is not abandoned although the reader has let go of it.
// The node socket notes each report as it reads it, before it queues it.
func (e *Engine) NoteReport(path string) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.reports[path]++
}

// reported reports whether a fill of the file at path was reported and is not recorded yet.
func (e *Engine) reported(path string) bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.reports[path] > 0
}

// recorded ends what NoteReport began.
func (e *Engine) recorded(path string) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.reports[path]--; e.reports[path] <= 0 {
		delete(e.reports, path)
	}
}

// listed reports whether some tier lists the file at path.
func (e *Engine) listed(path string) bool {
	for _, t := range e.tiers {
		if t.Listed(path) {
			return true
		}
	}
	return false
}

// publishFill publishes a reader's fill file f of tier from as entry into t: linked into
// place when t is that tier, else copied (and checked against the reported checksum).
func publishFill(t, from *tiers.Tier, entry tiers.Entry, f *tiers.Fill) error {
	if t == from {
		return t.Adopt(entry, f)
	}
	return t.PublishFill(entry, f)
}

// fillWhole copies the whole source file src into the tiers. A small one (under ReadNowBytes,
// the readers' limit: capi/fclimits.h) is written into its claim's fill file, with its
// checksum computed on the way, and placed as RecordFill places a reader's (adopted into the
// first tier: linked into place, no second file, no second copy). The first tier's room for
// it is reserved before a byte is written (tiers.Claim.Fill): without room there now, or
// without a fill file (a tier that refused the claim), or for a larger file, the copy goes
// the way fillFromSource takes it, which evicts or writes into a later tier.
func (e *Engine) fillWhole(claim tiers.Claim, src *Source, entry tiers.Entry) error {
	if entry.Size >= ReadNowBytes {
		return e.fillFromSource(src, entry, 0)
	}
	fill, err := claim.Fill(entry, src.RangeReader(0, entry.Size))
	if errors.Is(err, tiers.ErrNoClaimFile) || errors.Is(err, tiers.ErrNoRoom) {
		return e.fillFromSource(src, entry, 0)
	}
	if err == nil {
		e.stats.serverFills.Add(1)
		first := e.tiers[0]
		err = first.Adopt(entry, fill)
		if errors.Is(err, tiers.ErrNoRoom) && len(e.tiers) > 1 { // the first tier closed meanwhile
			err = e.place(1, entry, content{fill: fill, fillTier: first})
		}
	}
	return e.placed(src, entry, err)
}

// fillRootsMax bounds the dataset roots remembered for marking (see noteFillRoot).
const fillRootsMax = 64

// noteFillRoot remembers root as one whose readers fill their misses, so that the limits
// can mark it full when the first tier's room runs out (see limiter.markFull).
func (e *Engine) noteFillRoot(root string) {
	if _, ok := e.fillRoots.Load(root); ok || e.fillRootsN.Load() >= fillRootsMax {
		return
	}
	if _, had := e.fillRoots.LoadOrStore(root, struct{}{}); !had {
		e.fillRootsN.Add(1)
	}
}

// markFillRootsFull marks every dataset root whose readers fill their misses as full in the
// first tier (tiers.Tier.MarkFull).
func (e *Engine) markFillRootsFull() {
	e.fillRoots.Range(func(r, _ any) bool {
		e.tiers[0].MarkFull(r.(string))
		return true
	})
}
