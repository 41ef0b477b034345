package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/user"
	"strconv"
	"strings"

	"github.com/fitcache/fitcache/nodetiers"
	"github.com/fitcache/fitcache/tiers"
)

// ls --node and clear --node look at the memory tiers on this node, of every user, rather
// than at a server's cache: they are for what servers that were killed left behind, and for a
// job epilog that removes it (see package nodetiers).

// nodeFlags are the flags of ls --node and clear --node.
type nodeFlags struct {
	node bool
	dirs []string
}

func addNodeFlags(fset *flag.FlagSet) *nodeFlags {
	nf := &nodeFlags{}
	fset.BoolVar(&nf.node, "node", false, "the memory tiers of every user on this node (fitcache-* in --dir), not the cache of a server")
	fset.Func("dir", "with --node: where the memory tiers are; repeat or separate with commas (default /dev/shm)", func(s string) error {
		for d := range strings.SplitSeq(s, ",") {
			if d != "" {
				nf.dirs = append(nf.dirs, d)
			}
		}
		return nil
	})
	return nf
}

// lsNode prints the memory tiers on this node.
func lsNode(nf *nodeFlags, asJSON bool) error {
	ts, err := nodetiers.List(nodetiers.Options{Dirs: nf.dirs})
	if asJSON {
		if ts == nil {
			ts = []nodetiers.Tier{}
		}
		if jerr := printJSON(struct {
			Tiers []nodetiers.Tier `json:"tiers"`
		}{ts}); jerr != nil {
			return jerr
		}
		return err
	}
	printNodeTiers(os.Stdout, ts, nil)
	if len(ts) > 0 {
		fmt.Println("total:", nodeTotal(ts))
	}
	return err
}

// clearNode removes the memory tiers on this node that no live server holds, of user ("" for
// every user; a user other than root clears only their own).
func clearNode(nf *nodeFlags, who string, dryRun, asJSON bool) error {
	uid := nodetiers.AnyUser
	if who != "" {
		var err error
		if uid, err = lookupUID(who); err != nil {
			return err
		}
	}
	rs, err := nodetiers.Clear(nodetiers.Options{Dirs: nf.dirs}, uid, dryRun)
	if errors.Is(err, nodetiers.ErrOtherUser) {
		return err
	}
	if asJSON {
		if rs == nil {
			rs = []nodetiers.Result{}
		}
		if jerr := printJSON(struct {
			DryRun  bool               `json:"dry_run"`
			Results []nodetiers.Result `json:"results"`
		}{dryRun, rs}); jerr != nil {
			return jerr
		}
		return err
	}
	ts := make([]nodetiers.Tier, len(rs))
	what := make([]string, len(rs))
	var done []nodetiers.Tier
	left := 0
	for i, r := range rs {
		ts[i], what[i] = r.Tier, r.Describe()
		if r.Action == nodetiers.Removed || r.Action == nodetiers.WouldRemove {
			done = append(done, r.Tier)
		} else {
			left++
		}
	}
	printNodeTiers(os.Stdout, ts, what)
	verb := "removed"
	if dryRun {
		verb = "would remove (dry run)"
	}
	if len(rs) > 0 {
		fmt.Printf("%s %s; %d left (skipped or failed)\n", verb, nodeTotal(done), left)
	}
	return err
}

// lookupUID returns the uid of who, a user name or a number.
func lookupUID(who string) (int, error) {
	if uid, err := strconv.Atoi(who); err == nil && uid >= 0 {
		return uid, nil
	}
	u, err := user.Lookup(who)
	if err != nil {
		return 0, err
	}
	return strconv.Atoi(u.Uid)
}

// printNodeTiers prints one line per tier and a total; what, when given, says what clear did
// with each (in place of whether a server holds it).
func printNodeTiers(w io.Writer, ts []nodetiers.Tier, what []string) {
	if len(ts) == 0 {
		fmt.Fprintln(w, "no memory tiers (fitcache-*) found")
		return
	}
	width := len("TIER DIRECTORY")
	for _, t := range ts {
		width = max(width, len(t.Path))
	}
	last := "SERVER"
	if what != nil {
		last = "CLEAR"
	}
	fmt.Fprintf(w, "%-*s  %-16s  %8s  %10s  %-19s  %s\n", width, "TIER DIRECTORY", "OWNER", "FILES", "SIZE", "NEWEST", last)
	for i, t := range ts {
		count, size := strconv.FormatInt(t.Files, 10), tiers.FormatBytes(t.Bytes)
		if !t.Readable {
			count, size = "-", "unreadable"
		}
		state := "none (left behind)"
		switch {
		case what != nil:
			state = what[i]
		case !t.Readable:
			state = "?"
		case t.Held:
			state = fmt.Sprintf("live, pid %d", t.HolderPID)
		}
		if t.Note != "" && t.Readable && what == nil {
			state += " [" + t.Note + "]"
		}
		owner := fmt.Sprintf("%s(%d)", t.User, t.UID)
		fmt.Fprintf(w, "%-*s  %-16s  %8s  %10s  %-19s  %s\n", width, t.Path, owner, count, size,
			t.Newest.Format("2006-01-02 15:04:05"), state)
	}
}

// nodeTotal says how many tiers ts are, with how many files and bytes.
func nodeTotal(ts []nodetiers.Tier) string {
	var files, bytes int64
	unreadable := 0
	for _, t := range ts {
		files += t.Files
		bytes += t.Bytes
		if !t.Readable {
			unreadable++
		}
	}
	s := fmt.Sprintf("%d directories, %d files, %s", len(ts), files, tiers.FormatBytes(bytes))
	if unreadable > 0 {
		s += fmt.Sprintf(" (%d unreadable, not counted)", unreadable)
	}
	return s
}
