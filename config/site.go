package config

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"strings"

	"github.com/fitcache/fitcache/core"
	"github.com/fitcache/fitcache/tiers"
)

// DefaultSitePath is where a site puts its limits for FitCache on a node (see Site).
const DefaultSitePath = "/etc/fitcache.conf"

// SitePath returns the site configuration's path: FITCACHE_SITE_CONFIG, else
// DefaultSitePath. (Any user can point FITCACHE_SITE_CONFIG elsewhere: the file is the policy
// FitCache keeps to on the site's behalf, not an enforcement. The job's memory cgroup and
// file-system quotas are the enforcement.)
func SitePath() string {
	if p := os.Getenv("FITCACHE_SITE_CONFIG"); p != "" {
		return p
	}
	return DefaultSitePath
}

// Site is a site's configuration for FitCache on its nodes, read from a file of
// "key = value" lines ("#" starts a comment):
//
//	memory_per_user = 16GiB   # the memory tiers of one server (a user's embedded server) together
//	memory_per_node = 64GiB   # the memory file system (/dev/shm) in all, every user's tiers included
//	disk_per_user   = 200GiB  # the other tiers of one server together
//	keep_free       = 10%     # left free in every tier's file system (a size, or % of it)
//	memory_reserve  = 25%     # of a job's memory limit, left to the job (a size, or %)
//	memory_at_exit  = clear   # the default: clear, disk or keep
//	allow_keep      = no      # may users keep memory tiers after their server exits?
//
// Users' options may lower these limits, never raise them (a user's memory_reserve may be
// larger than the site's, not smaller).
type Site struct {
	Path          string              `json:"path,omitempty"` // the file read; "" when there is none
	MemoryPerUser int64               `json:"memory_per_user,omitempty"`
	MemoryPerNode int64               `json:"memory_per_node,omitempty"`
	DiskPerUser   int64               `json:"disk_per_user,omitempty"`
	KeepFree      tiers.SizeOrPercent `json:"keep_free"`
	MemoryReserve tiers.SizeOrPercent `json:"memory_reserve"`
	MemoryAtExit  core.MemoryAtExit   `json:"memory_at_exit"`
	AllowKeep     bool                `json:"allow_keep"`
}

// DefaultKeepFree is what every tier leaves free in its file system when the site says
// nothing: with the default budgets (a quarter of /dev/shm each), a few users' caches
// together would otherwise fill /dev/shm for everyone on the node.
const DefaultKeepFree = "10%"

// defaultSite is the configuration of a node without a site file.
func defaultSite() Site {
	keep, _ := tiers.ParseSize(DefaultKeepFree)
	reserve, _ := tiers.ParseSize(core.DefaultMemoryReserve)
	return Site{KeepFree: keep, MemoryReserve: reserve, MemoryAtExit: core.MemoryClear, AllowKeep: true}
}

// LoadSite reads the site configuration at path; a missing file gives the defaults. A
// malformed file is an error that names the file and line: a site's limit must not be
// dropped silently.
func LoadSite(path string) (Site, error) {
	site := defaultSite()
	f, err := os.Open(path)
	if errors.Is(err, os.ErrNotExist) {
		return site, nil
	}
	if err != nil {
		return Site{}, fmt.Errorf("site configuration: %w", err)
	}
	defer f.Close()
	site.Path = path
	sc := bufio.NewScanner(f)
	for line := 1; sc.Scan(); line++ {
		text, _, _ := strings.Cut(sc.Text(), "#")
		if strings.TrimSpace(text) == "" {
			continue
		}
		key, value, ok := strings.Cut(text, "=")
		key, value = strings.TrimSpace(key), strings.TrimSpace(value)
		if !ok || value == "" {
			return Site{}, fmt.Errorf("%s:%d: want key = value, got %q", path, line, sc.Text())
		}
		if err := site.set(key, value); err != nil {
			return Site{}, fmt.Errorf("%s:%d: %s: %w", path, line, key, err)
		}
	}
	if err := sc.Err(); err != nil {
		return Site{}, fmt.Errorf("site configuration %s: %w", path, err)
	}
	return site, nil
}

// set sets one key of the site configuration.
func (s *Site) set(key, value string) error {
	bytes := func(dst *int64) error {
		n, err := tiers.ParseSize(value)
		if err != nil || n.Percent != 0 || n.Bytes <= 0 {
			return fmt.Errorf("want a size such as 16GiB, got %q", value)
		}
		*dst = n.Bytes
		return nil
	}
	sizeOrPercent := func(dst *tiers.SizeOrPercent) error {
		n, err := tiers.ParseSize(value)
		if err != nil {
			return err
		}
		*dst = n
		return nil
	}
	switch key {
	case "memory_per_user":
		return bytes(&s.MemoryPerUser)
	case "memory_per_node":
		return bytes(&s.MemoryPerNode)
	case "disk_per_user":
		return bytes(&s.DiskPerUser)
	case "keep_free":
		return sizeOrPercent(&s.KeepFree)
	case "memory_reserve":
		if err := sizeOrPercent(&s.MemoryReserve); err != nil || s.MemoryReserve == (tiers.SizeOrPercent{}) {
			return fmt.Errorf("want a size or a percentage above 0, got %q", value)
		}
		return nil
	case "memory_at_exit":
		m, err := core.ParseMemoryAtExit(value)
		s.MemoryAtExit = m
		return err
	case "allow_keep":
		switch strings.ToLower(value) {
		case "yes", "true", "1":
			s.AllowKeep = true
		case "no", "false", "0":
			s.AllowKeep = false
		default:
			return fmt.Errorf("want yes or no, got %q", value)
		}
		return nil
	}
	return fmt.Errorf("unknown key (known: memory_per_user, memory_per_node, disk_per_user, keep_free, " +
		"memory_reserve, memory_at_exit, allow_keep)")
}

// loadMemoryOptions reads the options memory_at_exit, memory_reserve and memory_limit, within
// the site's configuration.
func (c *Config) loadMemoryOptions(get func(string) string) error {
	c.MemoryAtExit = c.Site.MemoryAtExit
	if v := get("memory_at_exit"); v != "" {
		m, err := core.ParseMemoryAtExit(v)
		if err != nil {
			return fmt.Errorf("option memory_at_exit: %w", err)
		}
		c.MemoryAtExit = m
	}
	c.MemoryReserve = c.Site.MemoryReserve
	if v := get("memory_reserve"); v != "" {
		n, err := tiers.ParseSize(v)
		if err != nil || n == (tiers.SizeOrPercent{}) {
			return fmt.Errorf("option memory_reserve: want a size or a percentage of the job's memory limit above 0, got %q", v)
		}
		c.MemoryReserve = n
	}
	c.FollowCgroup = true
	switch v := get("memory_limit"); v {
	case "", "cgroup":
	case "none":
		c.FollowCgroup = false
	default:
		return fmt.Errorf("option memory_limit: want cgroup (follow the job's memory cgroup) or none, got %q", v)
	}
	return nil
}

// Limits returns the limits a server keeps its tiers within: the site's, and with
// FollowCgroup the memory cgroup read by memory (nil when the server is in none).
func (c Config) Limits(memory func() (core.MemoryReading, error)) core.Limits {
	l := core.Limits{Reserve: c.MemoryReserve, SiteReserve: c.Site.MemoryReserve, MemoryPerUser: c.Site.MemoryPerUser,
		MemoryPerNode: c.Site.MemoryPerNode, DiskPerUser: c.Site.DiskPerUser, KeepFree: c.Site.KeepFree}
	if c.FollowCgroup {
		l.Memory = memory
	}
	return l
}

// ExitPolicy returns what the server does with its memory tiers as it exits, with a warning
// when the user asked to keep them and the site does not allow it.
func (c Config) ExitPolicy() (core.MemoryAtExit, string) {
	if c.MemoryAtExit == core.MemoryKeep && !c.Site.AllowKeep {
		return core.MemoryClear, fmt.Sprintf("memory_at_exit=keep is not allowed on this node (allow_keep = no in %s): "+
			"the memory tier is cleared when the server exits", c.Site.Path)
	}
	return c.MemoryAtExit, ""
}
