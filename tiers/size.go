package tiers

import (
	"fmt"
	"strconv"
	"strings"
)

// ParseSize parses a byte count such as "1048576", "512MiB", "64GiB", "1.5TB", or a
// percentage of a file system's capacity such as "80%", which [SizeOrPercent.Resolve] turns
// into bytes once the capacity is known.
func ParseSize(s string) (SizeOrPercent, error) {
	s = strings.TrimSpace(s)
	if s == "" {
		return SizeOrPercent{}, fmt.Errorf("empty size")
	}
	if strings.HasSuffix(s, "%") {
		p, err := strconv.ParseFloat(strings.TrimSpace(strings.TrimSuffix(s, "%")), 64)
		if err != nil || p <= 0 || p > 100 {
			return SizeOrPercent{}, fmt.Errorf("bad percentage %q: want a number in (0, 100]", s)
		}
		return SizeOrPercent{Percent: p}, nil
	}
	num, unit := s, ""
	if i := strings.IndexFunc(s, func(r rune) bool { return (r < '0' || r > '9') && r != '.' }); i >= 0 {
		num, unit = s[:i], strings.TrimSpace(s[i:])
	}
	v, err := strconv.ParseFloat(num, 64)
	if err != nil || v < 0 {
		return SizeOrPercent{}, fmt.Errorf("bad size %q", s)
	}
	mult, ok := units[strings.ToLower(unit)]
	if !ok {
		return SizeOrPercent{}, fmt.Errorf("bad size %q: unknown unit %q (use B, KiB, MiB, GiB, TiB, KB, MB, GB, TB or %%)", s, unit)
	}
	return SizeOrPercent{Bytes: int64(v * float64(mult))}, nil
}

var units = map[string]int64{
	"": 1, "b": 1,
	"k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20,
	"g": 1 << 30, "gib": 1 << 30, "t": 1 << 40, "tib": 1 << 40,
	"kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
}

// SizeOrPercent is a parsed size: either an absolute byte count or a percentage of a file
// system's capacity.
type SizeOrPercent struct {
	Bytes   int64
	Percent float64 // > 0 when the size was given as a percentage
}

// Resolve returns the size in bytes, taking percentages of capacity.
func (s SizeOrPercent) Resolve(capacity int64) int64 {
	if s.Percent > 0 {
		return int64(float64(capacity) * s.Percent / 100)
	}
	return s.Bytes
}

// String formats the size as it was given.
func (s SizeOrPercent) String() string {
	if s.Percent > 0 {
		return strconv.FormatFloat(s.Percent, 'f', -1, 64) + "%"
	}
	return FormatBytes(s.Bytes)
}

// FormatBytes formats n with a binary unit, for logs and reports: 1536 -> "1.5KiB".
func FormatBytes(n int64) string {
	const unit = 1024
	if n < unit {
		return fmt.Sprintf("%dB", n)
	}
	div, exp := int64(unit), 0
	for m := n / unit; m >= unit; m /= unit {
		div *= unit
		exp++
	}
	return fmt.Sprintf("%.1f%ciB", float64(n)/float64(div), "KMGTPE"[exp])
}
