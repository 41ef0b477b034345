package mountinfo

import (
	"os"
	"testing"

	"github.com/google/go-cmp/cmp"
)

const sample = `22 1 0:21 / / rw,relatime - ext4 /dev/vda rw
27 22 0:25 / /dev/shm rw,nosuid,nodev - tmpfs tmpfs rw,size=24684084k
44 27 0:39 / /mnt/fc\040huge rw,relatime - tmpfs tmpfs rw,size=8388608k,huge=within_size
45 44 0:40 /sub /mnt/fc\040huge/inner rw shared:7 master:1 - tmpfs tmpfs rw,size=1024k
46 22 0:41 / /mnt/fc-huge rw,relatime - tmpfs tmpfs rw,huge=always
`

func TestParseReadsEveryMountAndUnescapesItsPaths(t *testing.T) {
	mounts, err := Parse([]byte(sample))
	if err != nil {
		t.Fatal(err)
	}
	want := []Mount{
		{Root: "/", Point: "/", FSType: "ext4", Super: []string{"rw"}},
		{Root: "/", Point: "/dev/shm", FSType: "tmpfs", Super: []string{"rw", "size=24684084k"}},
		{Root: "/", Point: "/mnt/fc huge", FSType: "tmpfs", Super: []string{"rw", "size=8388608k", "huge=within_size"}},
		{Root: "/sub", Point: "/mnt/fc huge/inner", FSType: "tmpfs", Super: []string{"rw", "size=1024k"}},
		{Root: "/", Point: "/mnt/fc-huge", FSType: "tmpfs", Super: []string{"rw", "huge=always"}},
	}
	if d := cmp.Diff(want, mounts); d != "" {
		t.Errorf("mounts (-want +got):\n%s", d)
	}
	if _, err := Parse([]byte("1 2 0:3 / /x rw tmpfs tmpfs rw\n")); err == nil {
		t.Error("a line without its separator parsed")
	}
}

func TestTheMountHoldingAPathIsTheInnermost(t *testing.T) {
	mounts, _ := Parse([]byte(sample))
	for path, want := range map[string]string{
		"/dev/shm/fitcache-0":     "/dev/shm",
		"/dev/shmem":              "/",
		"/mnt/fc huge/a/b":        "/mnt/fc huge",
		"/mnt/fc huge/inner/x":    "/mnt/fc huge/inner",
		"/mnt/fc-huge":            "/mnt/fc-huge",
		"/var/tmp/fitcache-bench": "/",
	} {
		m, err := holding(mounts, path)
		if err != nil || m.Point != want {
			t.Errorf("%s: held by %q (%v), want %q", path, m.Point, err, want)
		}
	}
	m, _ := holding(mounts, "/mnt/fc huge/x")
	if v, ok := m.Option("huge"); !ok || v != "within_size" {
		t.Errorf("huge option %q, %v; want within_size", v, ok)
	}
	if _, ok := mounts[1].Option("huge"); ok {
		t.Error("/dev/shm has no huge option, found one")
	}
}

func TestHoldingFindsThisProcesssMountOfAPath(t *testing.T) {
	if _, err := os.Stat("/proc/self/mountinfo"); err != nil {
		t.Skip("no /proc/self/mountinfo:", err)
	}
	m, err := Holding(os.TempDir())
	if err != nil || m.Point == "" || m.FSType == "" {
		t.Fatalf("the mount of %s: %+v, %v", os.TempDir(), m, err)
	}
}
