package server

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
)

// errReadyLink reports a ready-file path that is a symbolic link, which could redirect the
// write to a file of the attacker's choosing.
var errReadyLink = errors.New("is a symbolic link; refusing to write through it")

// checkReadyFile refuses a ready-file path that exists as a symbolic link.
func checkReadyFile(path string) error {
	fi, err := os.Lstat(path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("ready file %s: %w", path, err)
	}
	if fi.Mode()&fs.ModeSymlink != 0 {
		return fmt.Errorf("ready file %s %w", path, errReadyLink)
	}
	return nil
}

// writeReadyFile writes content to path (mode 0600) without ever following a symbolic
// link: into a new temporary file beside it, renamed into place (a rename replaces a link
// planted after checkReadyFile instead of writing through it). It refuses a path that is a
// link.
func writeReadyFile(path, content string) error {
	if err := checkReadyFile(path); err != nil {
		return err
	}
	f, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".tmp-*") // O_EXCL, 0600
	if err != nil {
		return fmt.Errorf("ready file: %w", err)
	}
	tmp := f.Name()
	_, err = f.WriteString(content)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp, path)
	}
	if err != nil {
		os.Remove(tmp)
		return fmt.Errorf("ready file %s: %w", path, err)
	}
	return nil
}
