package main

import (
	"time"

	"golang.org/x/sys/unix"
)

// cpuClock is the CPU time a whole process has used (all its threads, user and system), read
// with nanosecond resolution from the kernel's per-process CPU clock: this process's or a
// child's (getrusage and /proc/PID/stat count in clock ticks, too coarse for a few hundred
// reads of a small file).
type cpuClock struct{ id int32 }

// selfCPU is this process's CPU clock.
func selfCPU() cpuClock { return cpuClock{id: unix.CLOCK_PROCESS_CPUTIME_ID} }

// processCPU is the CPU clock of the process pid (clock_getcpuclockid(3): the clock id of a
// process is ^pid<<3 | CPUCLOCK_SCHED).
func processCPU(pid int) cpuClock { return cpuClock{id: int32(^pid<<3 | 2)} }

// now returns the CPU time used so far, or 0 if the clock cannot be read (the process ended).
func (c cpuClock) now() time.Duration {
	var ts unix.Timespec
	if unix.ClockGettime(c.id, &ts) != nil {
		return 0
	}
	return time.Duration(ts.Nano())
}
