package discovery

import (
	"bufio"
	"errors"
	"fmt"
	"net"
	"os"
	"strconv"
	"strings"

	"github.com/fitcache/fitcache/ring"
)

// Spec says where the servers are.
type Spec struct {
	// Servers is "host:port,..." (an explicit list), "@PATH" (a hostfile: one host or
	// host:port per line, '#' comments, words after the first ignored; a regular file of at
	// most maxFileBytes and maxHosts hosts), or "slurm" (the
	// nodes of SLURM_JOB_NODELIST).
	Servers string
	// PerNode servers run on each host given without a port, on ports BasePort,
	// BasePort+1, ... (default 1 and 7070).
	PerNode  int
	BasePort int
	// NodeList overrides SLURM_JOB_NODELIST (for tests).
	NodeList string
	// Topology gives the nodes' failure domains (switches, racks), "" for none: see
	// topology.go.
	Topology string
}

// Job returns what a client of a cluster job needs to reach its servers: the servers (see
// Discover) and the job token (see LoadToken: token, or the file tokenFile).
func Job(s Spec, token, tokenFile string) ([]ring.Member, string, error) {
	members, err := Discover(s)
	if err != nil {
		return nil, "", err
	}
	token, err = LoadToken(token, tokenFile)
	if err != nil {
		return nil, "", err
	}
	return members, token, nil
}

// Discover returns the servers as ring members (ID "host:port", Node the host, Domain its
// failure domain from the topology), in a deterministic order.
func Discover(s Spec) ([]ring.Member, error) {
	domainOf, err := domains(s.Topology)
	if err != nil {
		return nil, err
	}
	members, err := discover(s)
	for i := range members {
		members[i].Domain = domainOf(members[i].Node)
	}
	return members, err
}

func discover(s Spec) ([]ring.Member, error) {
	if s.PerNode <= 0 {
		s.PerNode = 1
	}
	if s.BasePort <= 0 {
		s.BasePort = 7070
	}
	var entries []string
	switch {
	case s.Servers == "":
		return nil, errors.New("no servers given")
	case s.Servers == "slurm":
		list := s.NodeList
		if list == "" {
			list = os.Getenv("SLURM_JOB_NODELIST")
		}
		if list == "" {
			return nil, errors.New(`servers "slurm": SLURM_JOB_NODELIST is not set (not inside a Slurm job?)`)
		}
		hosts, err := ExpandHostlist(list)
		if err != nil {
			return nil, err
		}
		entries = hosts
	case strings.HasPrefix(s.Servers, "@"):
		hosts, err := readHostfile(s.Servers[1:])
		if err != nil {
			return nil, err
		}
		entries = hosts
	default:
		for _, e := range strings.Split(s.Servers, ",") {
			if e = strings.TrimSpace(e); e != "" {
				entries = append(entries, e)
			}
		}
	}
	var out []ring.Member
	seen := map[string]bool{}
	for _, e := range entries {
		host, port, err := net.SplitHostPort(e)
		if err != nil { // a bare host: PerNode servers from BasePort
			for i := 0; i < s.PerNode; i++ {
				addr := net.JoinHostPort(e, strconv.Itoa(s.BasePort+i))
				if !seen[addr] {
					seen[addr] = true
					out = append(out, ring.Member{ID: addr, Node: e})
				}
			}
			continue
		}
		if _, err := strconv.Atoi(port); err != nil || host == "" {
			return nil, fmt.Errorf("server %q: want host:port", e)
		}
		if !seen[e] {
			seen[e] = true
			out = append(out, ring.Member{ID: e, Node: host})
		}
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("servers %q: the list is empty", s.Servers)
	}
	return out, nil
}

// readHostfile reads a hostfile, bounded as a topology file is (see openListFile), and of at
// most maxHosts hosts.
func readHostfile(path string) ([]string, error) {
	f, err := openListFile("hostfile", path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var hosts []string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := sc.Text()
		if i := strings.IndexByte(line, '#'); i >= 0 {
			line = line[:i]
		}
		if fields := strings.Fields(line); len(fields) > 0 {
			if len(hosts) == maxHosts {
				return nil, fmt.Errorf("hostfile %s: more than %d hosts", path, maxHosts)
			}
			hosts = append(hosts, fields[0])
		}
	}
	return hosts, sc.Err()
}
