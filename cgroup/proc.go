package cgroup

import (
	"fmt"
	"path"
	"path/filepath"
	"slices"
	"strings"

	"github.com/fitcache/fitcache/internal/mountinfo"
)

// procPaths are a process's cgroup paths from /proc/PID/cgroup.
type procPaths struct {
	v1, v2       string // the v1 memory hierarchy's path; the v2 ("0::") path
	hasV1, hasV2 bool
}

// parseProcCgroup reads lines "ID:CONTROLLERS:PATH". The v1 memory line lists "memory"
// among its controllers ("4:memory:/x", "4:memory,foo:/x"); the v2 line is "0::/path".
func parseProcCgroup(data []byte) (procPaths, error) {
	var p procPaths
	for i, line := range strings.Split(strings.TrimRight(string(data), "\n"), "\n") {
		if line == "" {
			continue
		}
		id, rest, ok1 := strings.Cut(line, ":")
		ctls, cgPath, ok2 := strings.Cut(rest, ":")
		if !ok1 || !ok2 || !strings.HasPrefix(cgPath, "/") {
			return procPaths{}, fmt.Errorf("line %d: malformed %q", i+1, line)
		}
		switch {
		case id == "0" && ctls == "":
			p.v2, p.hasV2 = cgPath, true
		case slices.Contains(strings.Split(ctls, ","), "memory"):
			p.v1, p.hasV1 = cgPath, true
		}
	}
	return p, nil
}

// mount is one cgroup fs mount from mountinfo.
type mount struct {
	root   string // the cgroup, within the hierarchy, mounted here
	point  string // where it is mounted
	fstype string
	super  []string // super options: a v1 hierarchy's controllers
}

// parseMountinfo returns the cgroup and cgroup2 mounts in mountinfo.
func parseMountinfo(data []byte) ([]mount, error) {
	all, err := mountinfo.Parse(data)
	if err != nil {
		return nil, err
	}
	var mounts []mount
	for _, m := range all {
		if m.FSType == "cgroup" || m.FSType == "cgroup2" {
			mounts = append(mounts, mount{root: m.Root, point: m.Point, fstype: m.FSType, super: m.Super})
		}
	}
	return mounts, nil
}

// resolve returns the directory of cgroup cgPath under a mount of fstype ("cgroup" with
// the memory controller, or "cgroup2") and that mount. The directory is the mount
// point joined with cgPath relative to the mount's root; in a container the root is often
// the container's own cgroup and cgPath "/". Of several mounts the one with the longest
// root holding cgPath wins.
func resolve(mounts []mount, fstype, cgPath string) (dir string, mt mount, ok bool) {
	best := -1
	for _, m := range mounts {
		if m.fstype != fstype || (fstype == "cgroup" && !slices.Contains(m.super, "memory")) {
			continue
		}
		rel, under := relative(m.root, cgPath)
		if !under || len(m.root) <= best {
			continue
		}
		best = len(m.root)
		dir, mt, ok = filepath.Join(m.point, rel), m, true
	}
	return dir, mt, ok
}

// relative returns cgPath relative to root, and whether cgPath is at or under root.
func relative(root, cgPath string) (string, bool) {
	root, cgPath = path.Clean(root), path.Clean(cgPath)
	switch {
	case root == "/":
		return cgPath, true
	case cgPath == root:
		return "/", true
	case strings.HasPrefix(cgPath, root+"/"):
		return cgPath[len(root):], true
	}
	return "", false
}
