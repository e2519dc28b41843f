// Package etcdkeys is the etcd key layout of ftcomm's jobs: the private
// contract between the members (package membership), the coordinators
// (package coordinator) and the tools of this module (the etcd host's
// roles, ftcoord, the load generator). Trainers never name a key: they
// read and write through membership.Member, and tools read jobs through
// coordinator.Admin.
package etcdkeys

import (
	"fmt"
	"strings"
)

// Layout is the etcd key layout under a root (default "/ftcomm"):
//
//	<root>/<job>/members/<id>                        member record, bound to its lease
//	<root>/<job>/epoch/revoked/<epoch>               revocation records
//	<root>/<job>/rdzv/<epoch>/…                      per-epoch rendezvous (Store)
//	<root>/<job>/commits/<step>                      durable commit records of the run (RecordCommit)
//	<root>/<job>/run                                 the job's current run (RunRecord)
//	<root>/<job>/claims/<id>                         a new incarnation asks the coordinator to confirm the old one dead
//	<root>/<job>/groups/<group>                      a replica group's shared lease (membership's GroupLease)
//	<root>/<job>/groupjoined/<group>                 the last registration bound to that lease, for the group's leader to watch
//	<root>/_coordinator/jobs/<job>/quorum            the current quorum: the whole list, compact
//	<root>/_coordinator/jobs/<job>/view              a change of the previous epoch: what members watch
//	<root>/_coordinator/jobs/<job>/viewfull          old layout (the whole list beside a JSON record): deleted at each publication
//	<root>/_coordinator/jobs/<job>/history/<epoch>   past quorums, as the record (bounded)
//	<root>/_coordinator/jobs/<job>/evicted/<id>      keep-out records of evicted members
//	<root>/_coordinator/jobs/<job>/settings          the job's settings document (JobSettings, signed)
//	<root>/_coordinator/election/…                   coordinator leader election
//	<root>/_coordinator/gossip/<name>                coordinators' gossip addresses
//	<root>/_coordinator/keys/<name>                  coordinators' quorum-signing key ids
//
// What members write lives under <root>/<job>/; what only coordinators
// write lives under <root>/_coordinator/ (job names cannot start with
// '_'), so that one pair of key ranges grants it in etcd's role-based
// access control (see etcdhost.ConfigureAuth). Epochs and steps in keys
// are zero-padded to 20 digits so they sort.
type Layout struct{ Root string }

// DefaultRoot is the key prefix when none is configured.
const DefaultRoot = "/ftcomm"

func (k Layout) root() string {
	if k.Root == "" {
		return DefaultRoot
	}
	return strings.TrimSuffix(k.Root, "/")
}

// Prefix returns "<root>/" (DefaultRoot when Root is empty): every key of
// the layout starts with it.
func (k Layout) Prefix() string { return k.root() + "/" }

func (k Layout) Job(job string) string         { return k.root() + "/" + job + "/" }
func (k Layout) Members(job string) string     { return k.Job(job) + "members/" }
func (k Layout) Member(job, id string) string  { return k.Members(job) + id }
func (k Layout) EpochPrefix(job string) string { return k.Job(job) + "epoch/" }
func (k Layout) Revocations(job string) string { return k.EpochPrefix(job) + "revoked/" }
func (k Layout) Rendezvous(job string) string  { return k.Job(job) + "rdzv/" }
func (k Layout) Coordinator() string           { return k.root() + "/_coordinator/" }
func (k Layout) Election() string              { return k.Coordinator() + "election" }
func (k Layout) CoordinatorGossip() string     { return k.Coordinator() + "gossip/" }
func (k Layout) CoordinatorKeys() string       { return k.Coordinator() + "keys/" }
func (k Layout) CoordinatorJobs() string       { return k.Coordinator() + "jobs/" }
func (k Layout) CoordinatorJob(job string) string {
	return k.CoordinatorJobs() + job + "/"
}
func (k Layout) Quorum(job string) string     { return k.CoordinatorJob(job) + "quorum" }
func (k Layout) QuorumView(job string) string { return k.CoordinatorJob(job) + "view" }
func (k Layout) QuorumViewFull(job string) string {
	return k.CoordinatorJob(job) + "viewfull"
}
func (k Layout) History(job string) string       { return k.CoordinatorJob(job) + "history/" }
func (k Layout) EvictedPrefix(job string) string { return k.CoordinatorJob(job) + "evicted/" }
func (k Layout) Evicted(job, id string) string   { return k.EvictedPrefix(job) + id }
func (k Layout) Revocation(job string, e uint64) string {
	return k.Revocations(job) + epochKey(e)
}
func (k Layout) HistoryEntry(job string, e uint64) string { return k.History(job) + epochKey(e) }
func (k Layout) Commits(job string) string                { return k.Job(job) + "commits/" }
func (k Layout) Commit(job string, step int64) string     { return k.Commits(job) + epochKey(uint64(step)) }
func (k Layout) Run(job string) string                    { return k.Job(job) + "run" }
func (k Layout) Claims(job string) string                 { return k.Job(job) + "claims/" }
func (k Layout) Claim(job, id string) string              { return k.Claims(job) + id }
func (k Layout) Settings(job string) string               { return k.CoordinatorJob(job) + "settings" }

// GroupLease is where a replica group's shared lease is recorded
// (membership.MemberConfig.GroupLease).
func (k Layout) GroupLease(job, group string) string { return k.Job(job) + "groups/" + group }

// GroupJoined names the last member that bound its registration to a
// replica group's shared lease; it is bound to that lease too. The group's
// leader watches it to hold every registration on its lease to a link.
func (k Layout) GroupJoined(job, group string) string { return k.Job(job) + "groupjoined/" + group }

// RendezvousPrefix is the rendezvous store's prefix of one epoch of a job.
func (k Layout) RendezvousPrefix(job string, e uint64) string {
	return k.Rendezvous(job) + epochKey(e)
}

func epochKey(e uint64) string { return fmt.Sprintf("%020d", e) }

// Parse splits a key under the root into job, kind and rest:
// "/ftcomm/j/members/a" → ("j", "members", "a"); a coordinator's key of a
// job has its kind prefixed with "_": "/ftcomm/_coordinator/jobs/j/quorum"
// → ("j", "_quorum", ""), ".../history/<e>" → ("j", "_history", "<e>").
// ok is false for a key that is not a job's.
func (k Layout) Parse(key string) (job, kind, rest string, ok bool) {
	r := k.Prefix()
	if !strings.HasPrefix(key, r) {
		return "", "", "", false
	}
	if cj := k.CoordinatorJobs(); strings.HasPrefix(key, cj) {
		parts := strings.SplitN(key[len(cj):], "/", 3)
		switch {
		case len(parts) < 2 || parts[0] == "":
			return "", "", "", false
		case len(parts) == 2:
			return parts[0], "_" + parts[1], "", true
		}
		return parts[0], "_" + parts[1], parts[2], true
	}
	parts := strings.SplitN(key[len(r):], "/", 3)
	if len(parts) < 2 || strings.HasPrefix(parts[0], "_") {
		return "", "", "", false
	}
	if len(parts) == 2 {
		return parts[0], parts[1], "", true
	}
	return parts[0], parts[1], parts[2], true
}
