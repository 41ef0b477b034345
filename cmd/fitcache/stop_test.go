package main

import (
	"errors"
	"os"
	"testing"
)

func TestCheckServerProcessRefusesOtherPrograms(t *testing.T) {
	// This test binary holds no `serve --embedded` command line; pid 1 is not ours (or, as
	// root, not a fitcache server either).
	for _, pid := range []int{os.Getpid(), 1} {
		if err := checkServerProcess(pid); !errors.Is(err, errNotOurServer) {
			t.Errorf("pid %d: got %v, want errNotOurServer", pid, err)
		}
	}
}
