package discovery

import (
	"fmt"
	"strconv"
	"strings"
)

// ExpandHostlist expands Slurm hostlist syntax into host names, in order: comma-separated
// terms, each a name with any number of bracketed range lists ("gpu[001-004,010]",
// "rack[1-2]-n[01-02]"). Zero padding of a range's lower bound is kept ("001-010" gives
// 001 ... 010). Duplicates are kept out, first occurrence wins.
func ExpandHostlist(list string) ([]string, error) {
	return expandHostlist(list, maxHosts)
}

// expandHostlist is ExpandHostlist with at most limit hosts (limit <= maxHosts), so that a
// file of hostlists (a topology) bounds all of them together, not each alone.
func expandHostlist(list string, limit int) ([]string, error) {
	terms, err := splitTop(list)
	if err != nil {
		return nil, err
	}
	var out []string
	seen := map[string]bool{}
	for _, term := range terms {
		hosts, err := expandTerm(term, limit)
		if err != nil {
			return nil, err
		}
		for _, h := range hosts {
			if !seen[h] {
				seen[h] = true
				out = append(out, h)
			}
		}
		if len(out) > limit {
			return nil, fmt.Errorf("hostlist %q: more than %d hosts", list, limit)
		}
	}
	return out, nil
}

// splitTop splits at commas outside brackets.
func splitTop(s string) ([]string, error) {
	var out []string
	depth, start := 0, 0
	for i, r := range s {
		switch r {
		case '[':
			depth++
			if depth > 1 {
				return nil, fmt.Errorf("hostlist %q: nested brackets", s)
			}
		case ']':
			depth--
			if depth < 0 {
				return nil, fmt.Errorf("hostlist %q: unbalanced ]", s)
			}
		case ',':
			if depth == 0 {
				out = append(out, s[start:i])
				start = i + 1
			}
		}
	}
	if depth != 0 {
		return nil, fmt.Errorf("hostlist %q: unbalanced [", s)
	}
	out = append(out, s[start:])
	var terms []string
	for _, t := range out {
		if t = strings.TrimSpace(t); t != "" {
			terms = append(terms, t)
		}
	}
	return terms, nil
}

// maxHosts bounds what a hostlist expands to, a term and the whole list alike, so that a typo
// ("n[0-99999]r[0-99999]") is an error, not a process out of memory.
const maxHosts = 100000

// expandTerm expands the first bracket group of term and recurses on the rest, into at
// most limit hosts.
func expandTerm(term string, limit int) ([]string, error) {
	open := strings.IndexByte(term, '[')
	if open < 0 {
		return []string{term}, nil
	}
	close := strings.IndexByte(term[open:], ']') + open
	prefix, ranges, rest := term[:open], term[open+1:close], term[close+1:]
	tails, err := expandTerm(rest, limit)
	if err != nil {
		return nil, err
	}
	var out []string
	for _, r := range strings.Split(ranges, ",") {
		lo, hi, ok := strings.Cut(strings.TrimSpace(r), "-")
		if !ok {
			hi = lo
		}
		a, err1 := strconv.Atoi(lo)
		b, err2 := strconv.Atoi(hi)
		if err1 != nil || err2 != nil || a > b || a < 0 {
			return nil, fmt.Errorf("hostlist term %q: bad range %q", term, r)
		}
		if b-a > limit || len(out)+(b-a+1)*len(tails) > limit {
			return nil, fmt.Errorf("hostlist term %q: more than %d hosts", term, limit)
		}
		width := len(lo)
		for i := a; i <= b; i++ {
			for _, tail := range tails {
				out = append(out, fmt.Sprintf("%s%0*d%s", prefix, width, i, tail))
			}
		}
	}
	return out, nil
}
