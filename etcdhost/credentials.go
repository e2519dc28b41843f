package etcdhost

import (
	"encoding/json"

	"github.com/ftcomm/ftcomm/membership"
)

// WriteCredentials stores c at path, readable by the owner only, with
// the format version membership.LoadCredentials reads. The file is
// replaced through a temporary file and a rename, so a reader never sees
// it half written.
func WriteCredentials(path string, c *membership.Credentials) error {
	cc := *c
	cc.Version = membership.CredentialsVersion
	b, err := json.MarshalIndent(cc, "", "  ")
	if err != nil {
		return err
	}
	return writeFileAtomic(path, append(b, '\n'), 0o600)
}
