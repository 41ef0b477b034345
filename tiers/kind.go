package tiers

import "fmt"

// Kind is the kind of storage behind a tier. Kinds order tiers from fastest to slowest.
type Kind int

// The tier kinds, fastest first.
const (
	Memory Kind = iota // DRAM through tmpfs (/dev/shm)
	PMem               // persistent memory through a DAX file system
	NVMe               // node-local NVMe SSD
	Disk               // any other local file system
	// NumKinds is the number of kinds: arrays indexed by Kind have that many entries.
	NumKinds = iota
)

var kindNames = [NumKinds]string{Memory: "memory", PMem: "pmem", NVMe: "nvme", Disk: "disk"}

// Kinds returns every kind, fastest first.
func Kinds() []Kind {
	kinds := make([]Kind, NumKinds)
	for i := range kinds {
		kinds[i] = Kind(i)
	}
	return kinds
}

// String returns the kind's name as used in configuration and statistics.
func (k Kind) String() string {
	if k < 0 || int(k) >= len(kindNames) {
		return fmt.Sprintf("kind(%d)", int(k))
	}
	return kindNames[k]
}

// ParseKind returns the Kind named s ("memory", "pmem", "nvme" or "disk").
func ParseKind(s string) (Kind, error) {
	for k, name := range kindNames {
		if name == s {
			return Kind(k), nil
		}
	}
	return 0, fmt.Errorf("unknown tier kind %q (want memory, pmem, nvme or disk)", s)
}

// DefaultBudget is the budget of a tier whose configuration gives none. Memory-like tiers
// share RAM with the training job, so they take less of their file system than storage tiers,
// which take 80% of the device as the design asks.
func (k Kind) DefaultBudget() string {
	if k == Memory || k == PMem {
		return "50%"
	}
	return "80%"
}
