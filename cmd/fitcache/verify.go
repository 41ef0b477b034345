package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"io/fs"
	"os"

	"github.com/fitcache/fitcache/config"
	"github.com/fitcache/fitcache/tiers"
)

// verifyCmd checks the data checksum of every cached file of the configured tiers and
// reports the damaged ones; it removes them when no running server holds the tier.
func verifyCmd(args []string) error {
	fs := flag.NewFlagSet("verify", flag.ExitOnError)
	tierSpec := fs.String("tiers", "", "tiers to check: kind:dir[:budget],... (default: FITCACHE_TIERS, else the embedded defaults)")
	fs.Parse(args)
	cfg, err := config.Load(map[string]string{"tiers": *tierSpec})
	if err != nil {
		return err
	}
	tierCfgs, err := cfg.TierConfigs()
	if err != nil {
		return err
	}
	if n := verifyTiers(os.Stdout, tierCfgs); n > 0 {
		return fmt.Errorf("%d damaged cache entries", n)
	}
	return nil
}

// verifyTiers verifies each tier, prints what it finds to w, and returns the number of
// damaged entries.
func verifyTiers(w io.Writer, tierCfgs []tiers.Config) int {
	damaged := 0
	for _, tc := range tierCfgs {
		r, err := tiers.Verify(tc, nil)
		switch {
		case errors.Is(err, fs.ErrNotExist):
			fmt.Fprintf(w, "tier %-6s %s: not present\n", tc.Kind, r.Dir)
			continue
		case err != nil:
			fmt.Fprintf(w, "tier %-6s %s: cannot check: %v\n", tc.Kind, r.Dir, err)
			continue
		}
		fmt.Fprintf(w, "tier %-6s %s: %d entries valid, %d damaged\n", tc.Kind, r.Dir, r.Valid, len(r.Damaged))
		for _, d := range r.Damaged {
			fmt.Fprintf(w, "  damaged %s\n", d)
		}
		damaged += len(r.Damaged)
		switch {
		case len(r.Damaged) == 0:
		case r.Removed:
			fmt.Fprintf(w, "  removed %d damaged entries\n", len(r.Damaged))
		default:
			fmt.Fprintf(w, "  not removed: the tier is held by %s; restart it with 'fitcache serve --verify' "+
				"(or FITCACHE_VERIFY=1) to remove them\n", r.Holder)
		}
	}
	return damaged
}
