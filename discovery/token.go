package discovery

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"strings"
)

// CreateTokenFile writes a new random job token to path with mode 0600 (failing if the file
// exists, so that a running job's token is never replaced) and returns it.
func CreateTokenFile(path string) (string, error) {
	b := make([]byte, 32)
	if _, err := rand.Read(b); err != nil {
		return "", err
	}
	token := hex.EncodeToString(b)
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return "", fmt.Errorf("token file: %w", err)
	}
	defer f.Close()
	if _, err := f.WriteString(token + "\n"); err != nil {
		return "", err
	}
	return token, nil
}

// LoadToken returns the job token: token itself if set, else the content of tokenFile,
// which must not be readable by others.
func LoadToken(token, tokenFile string) (string, error) {
	if token != "" || tokenFile == "" {
		return token, nil
	}
	fi, err := os.Stat(tokenFile)
	if err != nil {
		return "", fmt.Errorf("token file: %w", err)
	}
	if fi.Mode().Perm()&0o077 != 0 {
		return "", fmt.Errorf("token file %s is readable by others (mode %o): chmod 600 it", tokenFile, fi.Mode().Perm())
	}
	b, err := os.ReadFile(tokenFile)
	if err != nil {
		return "", err
	}
	t := strings.TrimSpace(string(b))
	if t == "" {
		return "", errors.New("token file " + tokenFile + " is empty")
	}
	return t, nil
}
