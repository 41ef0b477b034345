package cgroup

import (
	"bytes"
	"fmt"
	"path"
	"path/filepath"
	"slices"
	"strings"
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

// parseMountinfo returns the cgroup and cgroup2 mounts in mountinfo: lines "ID PARENT
// MAJ:MIN ROOT POINT OPTIONS [OPTIONAL...] - FSTYPE SOURCE SUPER".
func parseMountinfo(data []byte) ([]mount, error) {
	var mounts []mount
	for i, line := range bytes.Split(data, []byte("\n")) {
		if len(line) == 0 {
			continue
		}
		f := strings.Fields(string(line))
		sep := slices.Index(f, "-")
		if sep < 6 || len(f) < sep+4 {
			return nil, fmt.Errorf("line %d: malformed %q", i+1, line)
		}
		fstype := f[sep+1]
		if fstype != "cgroup" && fstype != "cgroup2" {
			continue
		}
		mounts = append(mounts, mount{
			root:   unescape(f[3]),
			point:  unescape(f[4]),
			fstype: fstype,
			super:  strings.Split(f[sep+3], ","),
		})
	}
	return mounts, nil
}

// unescape undoes mountinfo's octal escapes (\040 for a space, \011, \012, \134).
func unescape(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) && isOctal(s[i+1]) && isOctal(s[i+2]) && isOctal(s[i+3]) {
			b.WriteByte((s[i+1]-'0')<<6 | (s[i+2]-'0')<<3 | (s[i+3] - '0'))
			i += 3
			continue
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

func isOctal(c byte) bool { return '0' <= c && c <= '7' }

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
