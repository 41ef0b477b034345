package main

import (
	"fmt"
	"strings"
	"testing"

	"github.com/fitcache/fitcache/core"
)

func TestSplitList(t *testing.T) {
	for _, tc := range []struct {
		in   string
		null bool
		want []string
	}{
		{"a\nb/c\r\n\nd", false, []string{"a", "b/c", "d"}},
		{"a b\x00c\nd\x00", false, []string{"a b", "c\nd"}}, // a NUL byte: NUL-separated
		{"x\x00y", true, []string{"x", "y"}},
		{"", false, nil},
	} {
		if got := splitList([]byte(tc.in), tc.null); fmt.Sprint(got) != fmt.Sprint(tc.want) {
			t.Errorf("splitList(%q, %v): got %q, want %q", tc.in, tc.null, got, tc.want)
		}
	}
}

func TestDescribeSaysHowAJobEnded(t *testing.T) {
	for _, tc := range []struct {
		info core.PrefetchInfo
		want string
	}{
		{core.PrefetchInfo{State: core.PrefetchDone, Files: 3, Done: 3, Fetched: 3}, "done: 3 fetched"},
		{core.PrefetchInfo{State: core.PrefetchBudget, Files: 9, Done: 4, Fetched: 4}, "tiers were full"},
		{core.PrefetchInfo{State: core.PrefetchOff}, "does not prefetch"},
		{core.PrefetchInfo{State: core.PrefetchDone, Failed: 1, Errors: []string{"/d/x: no such file"}}, "failed: /d/x"},
	} {
		if got := describe(tc.info); !strings.Contains(got, tc.want) {
			t.Errorf("describe(%+v) = %q, want it to contain %q", tc.info, got, tc.want)
		}
	}
}
