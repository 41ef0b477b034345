package tiers

import (
	"errors"
	"log/slog"
)

// VerifyReport is what Verify found in a tier.
type VerifyReport struct {
	Dir     string   // the directory checked (the private stand-in, if the tier has one)
	Valid   int      // entries whose data match their checksum
	Damaged []Damage // entries that must not be served
	// Removed says whether the damaged entries were removed. They are not when a running
	// server holds the tier (Holder names it): it must restart with Config.Verify.
	Removed bool
	Holder  string
}

// Verify checks every entry of the tier cfg describes, data checksums included. When it
// can take the tier's lock it repairs the tier as a server starting with Config.Verify would
// (damaged entries removed); when a running server holds the tier it only reports. A
// missing tier directory is not created: the error wraps fs.ErrNotExist. A tier with a
// fallback record (the default memory tier) is checked where a server would put it: its
// private stand-in when the configured directory cannot be used.
func Verify(cfg Config, log *slog.Logger) (VerifyReport, error) {
	dir, err := Existing(cfg)
	if err != nil {
		return VerifyReport{Dir: cfg.Dir}, err
	}
	cfg.Dir, cfg.FallbackRecord, cfg.Verify = dir, "", true
	r := VerifyReport{Dir: cfg.Dir}
	t, err := New(cfg, log)
	if errors.Is(err, ErrLocked) {
		r.Holder = Holder(cfg.Dir)
		r.Valid, r.Damaged, err = Dir{Path: cfg.Dir, Kind: cfg.Kind}.Check()
		return r, err
	}
	if err != nil {
		return r, err
	}
	defer t.Close()
	r.Valid, r.Damaged, r.Removed = t.Info().Files, t.Damaged(), true
	return r, nil
}
