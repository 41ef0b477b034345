package tiers

import (
	"fmt"
	"io"
)

// PublishFrom is a stand-in until the tiers branch lands: it reads r whole.
func (t *Tier) PublishFrom(e Entry, r io.Reader) error {
	data := make([]byte, e.Size)
	if _, err := io.ReadFull(r, data); err != nil {
		return err
	}
	if n, err := r.Read(make([]byte, 1)); n > 0 || err != io.EOF {
		return fmt.Errorf("publish %s: more bytes than %d or %w", e.SourcePath, e.Size, err)
	}
	return t.Publish(e, data)
}
