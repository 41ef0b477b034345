// Package mountinfo reads the mounts of a process's mount namespace from its
// /proc/PID/mountinfo (see proc_pid_mountinfo(5)).
package mountinfo

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
)

// Mount is one line of mountinfo.
type Mount struct {
	Root   string   // the directory of the file system mounted here
	Point  string   // where it is mounted
	FSType string   // "tmpfs", "cgroup2", ...
	Super  []string // the file system's own options ("size=8388608k", "huge=within_size", ...)
}

// Option returns the value of the super option name ("huge" of "huge=within_size"), and
// whether the mount has it.
func (m Mount) Option(name string) (string, bool) {
	for _, o := range m.Super {
		if k, v, _ := strings.Cut(o, "="); k == name {
			return v, true
		}
	}
	return "", false
}

// Parse returns the mounts of mountinfo's lines "ID PARENT MAJ:MIN ROOT POINT OPTIONS
// [OPTIONAL...] - FSTYPE SOURCE SUPER", in their order.
func Parse(data []byte) ([]Mount, error) {
	var mounts []Mount
	for i, line := range bytes.Split(data, []byte("\n")) {
		if len(line) == 0 {
			continue
		}
		f := strings.Fields(string(line))
		sep := slices.Index(f, "-")
		if sep < 6 || len(f) < sep+4 {
			return nil, fmt.Errorf("line %d: malformed %q", i+1, line)
		}
		mounts = append(mounts, Mount{Root: unescape(f[3]), Point: unescape(f[4]), FSType: f[sep+1],
			Super: strings.Split(f[sep+3], ",")})
	}
	return mounts, nil
}

// Holding returns the mount of this process's namespace that holds path (its links
// resolved): the last one mounted on the longest mount point above it.
func Holding(path string) (Mount, error) {
	real, err := filepath.EvalSymlinks(path)
	if err != nil {
		return Mount{}, err
	}
	data, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return Mount{}, err
	}
	mounts, err := Parse(data)
	if err != nil {
		return Mount{}, fmt.Errorf("/proc/self/mountinfo: %w", err)
	}
	return holding(mounts, real)
}

// holding is Holding over mounts, for the absolute clean path real.
func holding(mounts []Mount, real string) (Mount, error) {
	best := -1
	for i, m := range mounts {
		if real == m.Point || m.Point == "/" || strings.HasPrefix(real, m.Point+"/") {
			if best < 0 || len(m.Point) >= len(mounts[best].Point) {
				best = i
			}
		}
	}
	if best < 0 {
		return Mount{}, fmt.Errorf("no mount holds %s", real)
	}
	return mounts[best], nil
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
