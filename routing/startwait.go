// How a cluster client waits for the job's servers at start. It waits for no server the job
// already knows dead, in any process: every server that answers its hello names the servers
// it holds dead (the servers' membership, its clients' reports, and listed servers that never
// joined the membership within the job's wait_timeout), and those are not waited for. Of the
// rest:
//
//   - A refused connection (nothing listens there) is a dead server at once when another
//     server of the job answered: it is asked again every second (Router.probeLoop) and rejoins
//     when it answers. A server on the reader's own node is given the start grace first,
//     unless an answering server's membership holds it alive (it was up moments ago: it
//     died): a job's readers often start with its servers (srun), and the node's server is
//     worth a moment.
//   - A server that does not answer in time (its host may still be starting) is waited for up
//     to wait_timeout, as long as no answering server names it dead. Answering servers are
//     asked again once a second meanwhile: a server killed moments ago is named as soon as
//     the membership finds it, and a server that never started is named by all once they
//     have been up for wait_timeout, so only the job's first clients wait for it.
//   - When no server answers at all, the client gives up after the start grace (a few
//     seconds, for servers started with the readers) with an error that names every address
//     and why it gave no answer.

package routing

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"sort"
	"strings"
	"syscall"
	"time"

	"github.com/fitcache/fitcache/rpc"
)

// startGrace is how long a client waits at start for a server that refuses connections
// while it may still be binding its port (readers started with their servers), and for the
// first answer from any server of the job. Capped by wait_timeout.
const startGrace = 5 * time.Second

// askAgainEvery paces the hellos to servers that answered, while a client waits for others:
// their view of the dead grows as the membership finds deaths.
const askAgainEvery = time.Second

// WaitGives is why a client stopped waiting for a server at start.
type WaitGives int

// What Decide gives.
const (
	WaitOn    WaitGives = iota // still waited for
	WaitNamed                  // an answering server named it dead
	WaitDead                   // refused (or not the job's) while others answered
	WaitGone                   // no answer within wait_timeout (or the grace)
)

// StartWait holds what a client learned while waiting for the job's servers at start. It is
// used by one goroutine.
type StartWait struct {
	begun    time.Time
	grace    time.Time         // see startGrace
	deadline time.Time         // see config.Config.WaitTimeout
	Named    map[string]string // server -> the server that named it dead
	joined   map[string]bool   // servers an answering server's membership holds alive
	Errs     map[string]error  // server -> why its last hello failed
	asked    time.Time         // when the servers that answered were last asked again
}

// NewStartWait begins a wait at start that gives up on a server after waitTimeout.
func NewStartWait(waitTimeout time.Duration) *StartWait {
	now := time.Now()
	return &StartWait{begun: now, grace: now.Add(min(waitTimeout, startGrace)), deadline: now.Add(waitTimeout),
		Named: map[string]string{}, joined: map[string]bool{}, Errs: map[string]error{}}
}

// AskAgain reports whether the servers that answered are due to be asked again.
func (w *StartWait) AskAgain() bool {
	if time.Since(w.asked) < askAgainEvery {
		return false
	}
	w.asked = time.Now()
	return true
}

// Answered records a server's hello reply: the servers it holds dead, other than those that
// answered this client themselves (its view may lag behind), and those its membership holds
// alive (joined).
func (w *StartWait) Answered(id string, dead, joined []string, alive func(id string) bool) {
	delete(w.Errs, id)
	for _, j := range joined {
		w.joined[j] = true
	}
	for _, d := range dead {
		if d != id && !alive(d) {
			if _, ok := w.Named[d]; !ok {
				w.Named[d] = id
			}
		}
	}
}

// Decide says whether to go on waiting for a server that has not answered, given whether
// any server of the job answered and whether the server is on the reader's node.
func (w *StartWait) Decide(id string, anyAnswered, local bool) WaitGives {
	if _, ok := w.Named[id]; ok {
		return WaitNamed
	}
	now := time.Now()
	err := w.Errs[id]
	switch {
	case !anyAnswered:
		if now.After(w.grace) {
			return WaitGone
		}
	case rpc.IsRefused(err) && (!local || w.joined[id] || now.After(w.grace)):
		return WaitDead
	case now.After(w.deadline):
		return WaitGone
	}
	return WaitOn
}

// RefusedBy reports a server that refused this client (its uid is not allowed): no point
// waiting for the others.
func RefusedBy(err error) bool { return errors.Is(err, fs.ErrPermission) }

// NoServerError is the error of a client that no server of the job answered within the
// start grace: every address, and why each gave no answer.
func (w *StartWait) NoServerError(ids []string) error {
	sort.Strings(ids)
	parts := make([]string, len(ids))
	var last error
	for i, id := range ids {
		err := w.Errs[id]
		parts[i] = id + ": " + whyNoAnswer(err)
		if err != nil {
			last = err
		}
	}
	return fmt.Errorf("no fitcache server of the job answered within %s (%s): %w",
		time.Since(w.begun).Round(100*time.Millisecond), strings.Join(parts, "; "), last)
}

// whyNoAnswer says in a few words why a server gave no hello.
func whyNoAnswer(err error) string {
	var timeout interface{ Timeout() bool }
	switch {
	case err == nil:
		return "no answer"
	case errors.Is(err, rpc.ErrUnproven):
		return "did not prove the job token (a wrong token, or not a server of this job)"
	case errors.Is(err, syscall.ECONNREFUSED):
		return "connection refused (no server listens there)"
	case errors.Is(err, syscall.ENOENT):
		return "no such socket (no server listens there)"
	case errors.As(err, &timeout) && timeout.Timeout(), errors.Is(err, syscall.ETIMEDOUT),
		errors.Is(err, context.DeadlineExceeded):
		return "timed out"
	case rpc.IsRefused(err):
		return "could not connect"
	}
	return err.Error()
}
