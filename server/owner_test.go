package server

// owner returns the id of the server a read of path goes to first (see
// routing.Router.Targets), or "".
func (c *rootReader) owner(path string) string {
	path, err := c.resolve(path)
	if err != nil {
		return ""
	}
	if t := c.cluster.Targets(path); len(t) > 0 {
		return t[0].ID()
	}
	return ""
}
