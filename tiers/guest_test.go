package tiers

import (
	"errors"
	"testing"

	"github.com/google/go-cmp/cmp"
)

func publishGroup(t *testing.T, tier *Tier, group, src string, n int) {
	t.Helper()
	data := make([]byte, n)
	if err := tier.Publish(Entry{SourcePath: src, Size: int64(n), MTimeNanos: 1, Group: group}, data); err != nil {
		t.Fatalf("publish %s: %v", src, err)
	}
}

// Guests (node-local copies of other servers' files) are evicted before any file of the
// server's own, even older ones, and are not spilled; room for a guest is made of guests only.
func TestGuestsGoFirstAndNeverPushOutOwnFiles(t *testing.T) {
	tier := newTier(t, Memory, "40KiB") // room for 5 entries of 4 KiB data + a record block
	guest := GuestGroup("/data")
	publishGroup(t, tier, "/data", "/data/own0", 4096)
	publishGroup(t, tier, guest, "/data/guest0", 4096)
	publishGroup(t, tier, "/data", "/data/own1", 4096)
	publishGroup(t, tier, guest, "/data/guest1", 4096)
	publishGroup(t, tier, "/data", "/data/own2", 4096)
	all := []string{"/data/own0", "/data/guest0", "/data/own1", "/data/guest1", "/data/own2"}
	if got := cached(t, tier, all...); len(got) != 5 {
		t.Fatalf("cached %v, want all 5", got)
	}
	if info := tier.Info(); info.Guests != 2 || info.GuestBytes != 2*EntrySize("/data/guest0", 4096) {
		t.Errorf("info: %d guests of %d bytes, want 2 of %d", info.Guests, info.GuestBytes, 2*EntrySize("/data/guest0", 4096))
	}

	// Room for a guest of /data: never of /data's own guests (a dataset's guests do not
	// replace each other), nor of the server's own files.
	if err := tier.MakeRoomForGuest(EntrySize("/data/x", 4096), "/data"); !errors.Is(err, ErrNoRoom) {
		t.Errorf("room for a guest of the dataset its guests are of: %v, want ErrNoRoom", err)
	}
	// Room for a guest of another dataset: of guests only, never of the server's own files.
	if err := tier.MakeRoomForGuest(3*EntrySize("/data/x", 4096), "/other"); !errors.Is(err, ErrNoRoom) {
		t.Errorf("room for a guest larger than the guests give: %v, want ErrNoRoom", err)
	}
	if diff := cmp.Diff([]string{"/data/own0", "/data/own1", "/data/own2"}, cached(t, tier, all...)); diff != "" {
		t.Errorf("after making room for a guest (-want +got):\n%s", diff)
	}

	// Room for an own file: the guests went already; then the oldest own file.
	publishGroup(t, tier, guest, "/data/guest2", 4096)
	spilled := 0
	if err := tier.MakeRoom(3*EntrySize("/data/x", 4096), "", func(*Mapping) { spilled++ }); err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff([]string{"/data/own1", "/data/own2"}, cached(t, tier, append(all, "/data/guest2")...)); diff != "" {
		t.Errorf("after making room for own files (-want +got):\n%s", diff)
	}
	if spilled != 1 {
		t.Errorf("%d victims spilled, want 1: the own file, not the guest", spilled)
	}
}

// A guest stays a guest across a restart (its group is in its record), and usage and clear
// report and match it under its dataset root.
func TestGuestsSurviveRescanAndShowInUsage(t *testing.T) {
	dir := t.TempDir()
	tier, err := New(Config{Dir: dir, Kind: Memory, Budget: "1MiB"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	publishGroup(t, tier, "/data", "/data/own", 100)
	publishGroup(t, tier, GuestGroup("/data"), "/data/guest", 100)
	tier.Close()
	tier, err = New(Config{Dir: dir, Kind: Memory, Budget: "1MiB"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer tier.Close()
	size := EntrySize("/data/own", 100)
	want := []Usage{{Group: "/data", Files: 1, Bytes: size}, {Group: "/data", Guest: true, Files: 1, Bytes: EntrySize("/data/guest", 100)}}
	if diff := cmp.Diff(want, tier.Usage()); diff != "" {
		t.Errorf("usage after a restart (-want +got):\n%s", diff)
	}
	if got, err := tier.Dir.Usage(); err != nil || !cmp.Equal(want, got) {
		t.Errorf("usage from the records: %v, %v; want %v", got, err, want)
	}
	if err := tier.MakeRoomForGuest(tier.Info().Budget-size, "/other"); err != nil {
		t.Fatalf("room for a guest after the restart: %v", err)
	}
	if got := cached(t, tier, "/data/own", "/data/guest"); !cmp.Equal(got, []string{"/data/own"}) {
		t.Errorf("after room for a guest: %v cached, want the own file only (the guest was a guest after the restart)", got)
	}
	publishGroup(t, tier, GuestGroup("/data"), "/data/guest", 100)
	if got := tier.Clear(func(root string) bool { return root == "/data" }, false); len(got) != 2 {
		t.Errorf("clear of /data removed %v, want its own files and its guests", got)
	}
}
