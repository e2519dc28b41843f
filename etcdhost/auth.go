package etcdhost

import (
	"context"
	"fmt"
	"strings"

	"github.com/ftcomm/ftcomm/internal/etcdkeys"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// The etcd roles ConfigureAuth creates.
const (
	RoleCoordinator = "ftcomm-coordinator"
	RoleTrainer     = "ftcomm-trainer"
)

// AuthRanges returns the key ranges [start, end) of etcd's role-based
// access control that ftcomm uses under root:
//
//   - coordinators read and write everything under <root>/;
//   - trainers (members) read everything under <root>/ and write
//     everything but <root>/_… — their jobs' member records, revocations,
//     rendezvous and commit records; not quorums, history, keep-out
//     records, the election or the coordinators' keys, which live under
//     <root>/_coordinator/ (job names cannot start with '_').
func AuthRanges(root string) (all, trainerWrite [][2]string) {
	p := etcdkeys.Layout{Root: root}.Prefix()
	end := clientv3.GetPrefixRangeEnd(p)
	all = [][2]string{{p, end}}
	// '_' + 1 is '`': the two ranges leave out exactly <root>/_….
	trainerWrite = [][2]string{{p, p + "_"}, {p + "`", end}}
	return all, trainerWrite
}

// ConfigureAuth turns on etcd's authentication with ftcomm's roles, as
// etcd's root user (cli must act as root: a client certificate with
// common name "root", or root's password). It creates the users
// UserRoot, UserCoordinator and UserTrainer (without
// passwords: they authenticate by client certificate; add a password with
// etcdctl user passwd for a cluster without client certificates) and the
// roles RoleCoordinator and RoleTrainer with the ranges of
// AuthRanges, then enables authentication. It can run again (after a
// restart, or for another root) and only adds what is missing.
func ConfigureAuth(ctx context.Context, cli *clientv3.Client, root string) error {
	fail := func(what string, err error) error {
		return fmt.Errorf("etcdhost: configure etcd auth: %s: %w", what, ctxErr(ctx, err))
	}
	exists := func(err error) bool {
		return err != nil && (strings.Contains(err.Error(), rpctypes.ErrUserAlreadyExist.Error()) ||
			strings.Contains(err.Error(), rpctypes.ErrRoleAlreadyExist.Error()))
	}
	for _, r := range []string{RoleCoordinator, RoleTrainer} {
		if _, err := cli.RoleAdd(ctx, r); err != nil && !exists(err) {
			return fail("add role "+r, err)
		}
	}
	all, trainerWrite := AuthRanges(root)
	grant := func(role string, ranges [][2]string, perm clientv3.PermissionType) error {
		for _, r := range ranges {
			if _, err := cli.RoleGrantPermission(ctx, role, r[0], r[1], perm); err != nil {
				return fail("grant "+role, err)
			}
		}
		return nil
	}
	if err := grant(RoleCoordinator, all, clientv3.PermissionType(clientv3.PermReadWrite)); err != nil {
		return err
	}
	if err := grant(RoleTrainer, all, clientv3.PermissionType(clientv3.PermRead)); err != nil {
		return err
	}
	// A read grant and a write grant of one range are kept apart by etcd;
	// READWRITE on the trainers' ranges says both at once.
	if err := grant(RoleTrainer, trainerWrite, clientv3.PermissionType(clientv3.PermReadWrite)); err != nil {
		return err
	}
	for _, u := range []struct{ user, role string }{
		{UserRoot, "root"}, {UserCoordinator, RoleCoordinator}, {UserTrainer, RoleTrainer},
	} {
		if _, err := cli.UserAddWithOptions(ctx, u.user, "", &clientv3.UserAddOptions{NoPassword: true}); err != nil && !exists(err) {
			return fail("add user "+u.user, err)
		}
		if _, err := cli.UserGrantRole(ctx, u.user, u.role); err != nil {
			return fail("grant role "+u.role+" to "+u.user, err)
		}
	}
	st, err := cli.AuthStatus(ctx)
	if err != nil {
		return fail("status", err)
	}
	if !st.Enabled {
		if _, err := cli.AuthEnable(ctx); err != nil {
			return fail("enable", err)
		}
	}
	return nil
}

// ctxErr prefers the cause of ctx's end over the client's rendering of it
// (a gRPC status), so callers can errors.Is(err, context.DeadlineExceeded).
func ctxErr(ctx context.Context, err error) error {
	if ctx.Err() != nil {
		return context.Cause(ctx)
	}
	return err
}
