package rpc

// Close is a stand-in until the network branch lands.
func (c *Client) Close() error {
	if cl, ok := c.kc.(interface{ Close() error }); ok {
		return cl.Close()
	}
	return nil
}
