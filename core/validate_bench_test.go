package core

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"
)

// BenchmarkValidate measures the check of one cached copy against its source (a new job's
// first epoch pays it once per file, ahead of the readers): the cost per file, on a source on
// local disk.
func BenchmarkValidate(b *testing.B) {
	e, err := NewEngine(EngineConfig{Tiers: testTiers(b, "256MiB")}, nil)
	if err != nil {
		b.Fatal(err)
	}
	defer e.Close()
	root := b.TempDir()
	const files = 2000
	paths := make([]string, files)
	for i := range paths {
		paths[i] = filepath.Join(root, fmt.Sprintf("d%02d", i%20), fmt.Sprintf("f%05d.bin", i))
		os.MkdirAll(filepath.Dir(paths[i]), 0o755)
		os.WriteFile(paths[i], []byte("x"), 0o644)
		if err := e.Fetch(b.Context(), root, paths[i]); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportAllocs()
	b.ResetTimer()
	for i := range b.N {
		if i%files == 0 {
			e.BeginSession(fmt.Sprint("job", i))
		}
		if err := e.validate(root, paths[i%files]); err != nil {
			b.Fatal(err)
		}
	}
}
