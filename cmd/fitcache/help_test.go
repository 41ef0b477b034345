package main

import (
	"os"
	"os/exec"
	"regexp"
	"slices"
	"strings"
	"testing"
)

// TestMain lets a test run this test binary as the fitcache command (see fitcacheCommand).
func TestMain(m *testing.M) {
	if os.Getenv("FITCACHE_TEST_AS_COMMAND") == "1" {
		main()
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// fitcacheCommand runs `fitcache args...` (this test binary as the command) and returns what
// it printed on standard output and standard error together.
func fitcacheCommand(t *testing.T, env []string, args ...string) (string, error) {
	t.Helper()
	cmd := exec.Command(os.Args[0], args...)
	cmd.Env = append(append(os.Environ(), env...), "FITCACHE_TEST_AS_COMMAND=1")
	out, err := cmd.CombinedOutput()
	return string(out), err
}

// goDefault is what the flag package appends to the help of a flag whose default is not its
// type's zero value.
var goDefault = regexp.MustCompile(`\(default [^)]*\)$`)

// No flag's help gives its default twice: once in the text ("default: FITCACHE_PREFETCH,
// else 16") and once as the flag package's "(default -1)", the value that stands for unset.
func TestHelpGivesEachDefaultOnce(t *testing.T) {
	names := make([]string, 0, len(commands))
	for name := range commands {
		names = append(names, name)
	}
	slices.Sort(names)
	flags := 0
	for _, name := range names {
		out, _ := fitcacheCommand(t, nil, name, "-h")
		// A flag's entry is its "  -name type" line and the indented lines of its help.
		for _, entry := range strings.Split(out, "\n  -")[1:] {
			flags++
			text := strings.Join(strings.Fields(entry), " ")
			if loc := goDefault.FindStringIndex(text); loc != nil && strings.Contains(text[:loc[0]], "default") {
				t.Errorf("fitcache %s -h: the default given twice: -%s", name, text)
			}
		}
	}
	if flags < 20 {
		t.Errorf("found the help of %d flags in all: the help's format changed, and this test finds nothing", flags)
	}
}
