package tiers

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"github.com/fitcache/fitcache/privdir/privdirtest"
)

// forged returns the data file of a cached copy of src: cached files hold exactly the
// source's bytes, so anyone can make one.
func forged(src string, data []byte) []byte { return bytes.Clone(data) }

// plantAsNobody writes file contents at path as the user nobody (creating its bins).
func plantAsNobody(t *testing.T, path string, contents []byte) {
	t.Helper()
	stage := filepath.Join(privdirtest.SharedDir(t), "stage")
	if err := os.WriteFile(stage, contents, 0o644); err != nil {
		t.Fatal(err)
	}
	privdirtest.AsNobody(t, fmt.Sprintf("mkdir -p %s && cp %s %s", filepath.Dir(path), stage, path))
}
